"""`sluice bench vision`'s images: generated PNGs (`png`) and deepseek-recipe's preprocessing
of them as the API's resolver does it (`preprocess`), for both parts of the bench
(``_vision_encoder``, ``_vision_ttft``). `services.bench.vision`'s module doc says how they
are used.
"""

from __future__ import annotations

import io
from typing import Literal

# image detail and limits as the API's resolver applies them by default
DETAIL: Literal["low", "high", "original", "auto"] = "auto"
MAX_SIDE_PX, LOW_DETAIL_PX = 8192, 512


def png(seed: int, width: int, height: int) -> bytes:
    """A random-noise RGB PNG (distinct per seed, so distinct encoder keys)."""
    import numpy as np
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def preprocess(data: bytes) -> tuple[int, bytes, int, int]:
    """deepseek-recipe's preprocessing, as the API's resolver does it: (tokens, WebP bytes,
    width, height); tokens is the recipe's count (checked against ``image_tokens``)."""
    import deepseek_recipe as dr

    from engine.model.vision import image_tokens

    info = dr.OpenCvImagePreprocessor().preprocess(
        bytes(data), dr.PreprocessOptions(DETAIL, MAX_SIDE_PX, LOW_DETAIL_PX)
    )
    tokens = dr.MultiModalData([info]).image_token_adjustment() + 1
    if tokens != image_tokens(info.width, info.height):
        raise RuntimeError(
            f"recipe counts {tokens} tokens for {info.width}x{info.height}, the encoder {image_tokens(info.width, info.height)}"
        )
    return tokens, bytes(info.data), int(info.width), int(info.height)
