"""What an admitted transformers release is too old for: proven model types and backends that fail, or do not exist,
before a given release, each with the measured failure.

Plain data, like `table.py`, and read at run time against the installed transformers
(`architectures.supported_model_types`, `architectures.backend_available`). Model types a release does not have at
all need no entry: the source scan refuses them (no causal LM entry). An entry comes from running
`.ci/transformers-range` on the older release and can go once `_compat.MIN_TRANSFORMERS_VERSION` passes its release.
"""

from packaging.version import Version

from ..._compat import TRANSFORMERS_VERSION


# (model type, backend) -> (first release on which transformers builds it, what happens before): the cell is n/a there.
BACKENDS_FROM: dict[tuple[str, str], tuple[str, str]] = {
    ("falcon", backend): (
        "5.23.0",
        f"FalconDecoderLayer looks {backend} up in FALCON_ATTENTION_CLASSES, which has no such key (KeyError)",
    )
    for backend in ("flash_attention_3", "flash_attention_4")
}


def backend_too_old(model_type: str, backend: str) -> str | None:
    """
    Why the installed transformers cannot build `model_type` on `backend` (`BACKENDS_FROM`), or None.

    Example:
    ```python
    >>> from llm_packing.hook.support.releases import backend_too_old
    >>> backend_too_old("llama", "flash_attention_3") is None
    True

    ```
    """
    if (model_type, backend) not in BACKENDS_FROM:
        return None
    since, failure = BACKENDS_FROM[model_type, backend]
    return None if TRANSFORMERS_VERSION >= Version(since) else f"before transformers {since}: {failure}"
