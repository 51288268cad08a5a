"""Serving runtime: export layout, TF-Serving-compatible model server, clients, recommender."""
