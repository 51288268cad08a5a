"""Constants of TF Serving's protocol shared by the server and the client."""
from __future__ import annotations

DEFAULT_SIGNATURE = "serving_default"
# The largest gRPC message TF Serving sends or receives.
INT32_MAX = 2**31 - 1
