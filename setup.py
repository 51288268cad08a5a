"""Installs the two-stage recommender: features, retrieval, ranking and serving."""
from setuptools import setup

STACK = [
    "tensorflow~=2.20.0",
    "tf-keras~=2.20.0",
    "tensorflow-recommenders==0.7.7",
    "scann==1.4.2",
    "tensorflow-datasets",
    "tensorflow-serving-api~=2.20.0",
    "numpy",
    "scipy",
    "pyarrow",
    "matplotlib",
    "tqdm",
    "grpcio",
    "requests",
    "uvicorn",
]

setup(
    name="tworec",
    version="0.1.0",
    description="From an interaction log to a served two-stage TFRS recommender.",
    python_requires=">=3.10,<3.13",
    packages=["features", "retrieval", "ranking", "serving"],
    install_requires=STACK,
    extras_require={
        "test": ["pytest>=7", "pytest-timeout"],
        "gpu": ["tensorflow[and-cuda]~=2.20.0"],
    },
)
