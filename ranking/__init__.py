"""The ranking stage."""
