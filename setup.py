"""megamamba: pretraining Mamba-1 / Mamba-2 language models with 3D parallelism.

The repository keeps the design card's top-level folders and installs them under `megamamba`:
`kernels/api/` is `megamamba.kernels` (the dispatching ops), `kernels/triton/` and
`kernels/reference/` its subpackages, `pipelines/` is `megamamba.pipelines`. `kernels/` has no
`__init__.py`, so it never shadows PyPI's `kernels`, which transformers imports
(docs/architecture.md).
"""

from setuptools import find_packages, setup


def _tree(root: str, name: str) -> dict[str, str]:
    """Map the import name `name` and its subpackages onto the folder `root`."""
    subs = {f"{name}.{p}": f"{root}/{p.replace('.', '/')}" for p in find_packages(root)}
    return {name: root, **subs}


PACKAGE_DIRS = {
    **_tree("megamamba", "megamamba"),
    **_tree("kernels/api", "megamamba.kernels"),
    **_tree("kernels/triton", "megamamba.kernels.triton"),
    **_tree("kernels/reference", "megamamba.kernels.reference"),
    **_tree("pipelines", "megamamba.pipelines"),
}

setup(
    name="megamamba",
    version="0.1.0.dev0",
    description="Pretrain Mamba-1 and Mamba-2 language models with tensor, pipeline and ZeRO data parallelism",
    python_requires=">=3.11",
    packages=list(PACKAGE_DIRS),
    package_dir=PACKAGE_DIRS,
    install_requires=[
        # Lower bounds are what our H200 benchmark machine has (torch 2.11, triton 3.6); an
        # installed torch that satisfies them is kept, so a GPU user keeps their CUDA build.
        "torch>=2.11",
        "triton>=3.6",
        "deepspeed>=0.19,<0.20",
        "einops>=0.8",
        "sentencepiece>=0.2",
        "tokenizers>=0.20",
        "tensorboard>=2.17",
        "safetensors>=0.4",
        "numpy>=1.26",
    ],
    # The test and lint extras: from the release the suite passes with (constraints.txt) to below the
    # next major (ruff and mypy: the next minor, whose rules and inference change). The eval extra: below.
    extras_require={
        "dev": [
            "pytest>=9.2,<10",
            "pytest-xdist>=3.8,<4",
            "ninja>=1.13",
            "transformers>=5.25,<6",
            "ruff>=0.17,<0.18",
            "mypy>=2.4,<2.5",
            "pre-commit>=4.7,<5",
        ],
        # `python -m megamamba.evaluate`: lm-eval with its transformers backend (accelerate, peft). Training never
        # imports it. megamamba/lm_eval_model.py overrides methods of lm-eval's HFLM, which change between its
        # minor releases: from the release the tests pass with to below the next minor.
        "eval": ["lm_eval[hf]>=0.4.13,<0.5"],
    },
)
