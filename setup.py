"""Installs the two-stage recommender under one import namespace, `tworec`.

The packages keep their top-level folders (the project's layout); `package_dir` maps
`tworec.NAME` to the folder NAME, so no generic top-level module (`features`, `serving`) is
installed.
"""
from setuptools import setup

STACK = [
    "tensorflow~=2.20.0",
    "tf-keras~=2.20.0",
    "tensorflow-recommenders==0.7.7",
    "scann==1.4.2",
    "tensorflow-datasets",
    "importlib_resources",      # TFDS imports it to download a data set, without requiring it
    "tensorflow-serving-api~=2.20.0",
    "numpy",
    "scipy",
    "pyarrow",
    "duckdb>=1.3",              # counts Parquet shards out of core (features.shards.describe)
    "matplotlib",
    "markdown",                 # report.html from report.md
    "tqdm",
    "grpcio",
    "requests",
    "uvicorn",
]

# Each is a folder at the top of the repository, installed as tworec.NAME.
PACKAGES = ["features", "evaluation", "retrieval", "ranking", "serving", "pipeline"]

setup(
    name="tworec",
    version="0.1.0",
    description="From an interaction log to a served two-stage TFRS recommender.",
    python_requires=">=3.10,<3.13",
    packages=["tworec"] + [f"tworec.{name}" for name in PACKAGES],
    package_dir={"tworec": "tworec", **{f"tworec.{name}": name for name in PACKAGES}},
    install_requires=STACK,
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.8"],
        "gpu": ["tensorflow[and-cuda]~=2.20.0"],
    },
)
