"""grpojax: GRPO for language models in JAX/Flax."""

import setuptools

setuptools.setup(
    name="grpojax",
    version="0.1.0",
    description="Group Relative Policy Optimization for language models in JAX/Flax NNX.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["grpojax", "grpojax.*"]),
    # The CPU decode kernels' source, built on first use (ops/cpu.py).
    package_data={"grpojax.ops": ["cpu_kernels.cc"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.4.35",
        "flax>=0.10.4",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.88",
        "ml-collections>=1.0",
        "absl-py>=2.1",
        "transformers>=4.46",
        "jinja2>=3.1",  # chat templates
        "datasets>=3.0",
        "safetensors>=0.4.5",
        "numpy>=1.26",
        "ml-dtypes>=0.4",  # bfloat16 host arrays when loading checkpoints
        "tqdm>=4.66",
        "math-verify>=0.7",
        "matplotlib>=3.7",
        "tensorboardX>=2.6",
    ],
    extras_require={
        # torch only for tests that compare against HF transformers' PyTorch models.
        # nbclient, nbformat, ipykernel: tests/test_colab.py runs the Colab notebook.
        # trl: its own reward functions in the TRL-format tests; wandb: the offline-mode logger
        # test; peft: loads the exported LoRA adapters onto the PyTorch model (none of them is
        # imported by the package itself).
        # pytest-xdist: the suite runs in two processes (-n 2), one per core.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "scipy>=1.11", "torch>=2.4", "trl>=1.0",
                 "wandb>=0.17", "peft>=0.13",
                 "nbclient>=0.10", "nbformat>=5.9", "ipykernel>=6.29"],
        "tpu": ["jax[tpu]>=0.4.35"],
        "cuda": ["jax[cuda12]>=0.4.35"],
        "wandb": ["wandb>=0.17"],
    },
)
