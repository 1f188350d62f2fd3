"""Image preprocessing through deepseek-recipe: encoded bytes -> encoder-ready pixels.

``prepare(data, detail, max_dimension_px, low_detail_max_dimension_px)`` runs the recipe's
``OpenCvImagePreprocessor`` (decode, orientation, resize to the V4.1 token grid: both sides
multiples of 14 px), decodes the recipe's output (lossy WebP bytes) to RGB with Pillow,
normalises it as the SigLIP2 tower expects (``(x / 255 - mean) / std``, mean = std = 0.5 per
channel by default) and asks the recipe for the image's token count under the V4.1 image
token specification (``MultiModalData([info]).image_token_adjustment() + 1``: the adjustment
counts the tokens beyond the one placeholder the image occupies in the prompt).

Every failure the recipe reports about the image itself (``ImageError``: empty, truncated or
corrupt bytes, an unsupported format, a side over ``max_dimension_px``; ``CalcResizeError``)
is raised as `ImageRejected`, a ``ValueError`` whose message says what the user can change.

``PreparedImage.key`` identifies the encoder output: SHA-256 over the original bytes, every
preprocessing option and a caller-supplied encoder fingerprint (e.g.
`engine.model.vision.vision_fingerprint`), so equal keys mean equal vision embeddings.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Final

import deepseek_recipe as dr
import numpy as np
import torch

#: The ``detail`` values the recipe accepts (deepseek_recipe's ``ImageDetail``).
DETAILS: Final = ("low", "high", "original", "auto")
#: SigLIP2's pixel normalisation: ``(x / 255 - mean) / std`` per RGB channel.
SIGLIP_MEAN: Final = (0.5, 0.5, 0.5)
SIGLIP_STD: Final = (0.5, 0.5, 0.5)

_KEY_DOMAIN: Final = b"sluice-image-v1"

# What a user can do about each ImageError kind the recipe's preprocessor raises.
_HINTS: Final = {
    "EmptyImage": "the image could not be decoded: it is empty, truncated or corrupt",
    "UnsupportedMediaType": "the data is not a supported image; send webp, png, jpeg or gif",
    "ImageDimensionsTooLarge": "the image is too large: each side must be at most {max_px} px; "
    "downscale it and retry",
    "Decode": "the image could not be decoded; re-encode it as png or jpeg and retry",
    "Resize": "the image could not be resized to the model's grid (extreme aspect ratio?); "
    "crop or pad it and retry",
    "TokenBudget": "the image does not fit the model's image token budget (extreme aspect ratio?); "
    "crop or pad it and retry",
    "ImageTooLarge": "the image file is too large; compress or downscale it",
    "CalcResizeError": "the image could not be fitted to the model's image token grid "
    "(extreme aspect ratio?); crop or pad it and retry",
}


class ImageRejected(ValueError):
    """The image cannot be used; the message says why and what to change. ``kind`` is the
    recipe's error kind (``EmptyImage``, ``UnsupportedMediaType``, ...), or ``InvalidDetail``,
    ``TokenCount`` or ``Unknown``."""

    def __init__(self, message: str, kind: str = "Unknown") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One preprocessed image, ready for `engine.model.vision.VisionEncoder`.

    ``pixels``: float32 ``[3, height, width]``, normalised. ``width``/``height``: pixels after
    the recipe's resize (multiples of 14). ``num_tokens``: the prompt tokens the image
    occupies (the recipe's count; equals ``image_tokens(width, height)`` and the encoder's
    output rows). ``detail``: as requested. ``key``: hex SHA-256 identity (see the module
    docstring); compare images by ``key`` (the dataclass compares by identity).
    """

    pixels: torch.Tensor = field(repr=False)
    width: int
    height: int
    num_tokens: int
    detail: str
    key: str


def image_key(
    data: bytes,
    detail: str,
    max_dimension_px: int,
    low_detail_max_dimension_px: int,
    encoder_fingerprint: str = "",
    mean: tuple[float, ...] = SIGLIP_MEAN,
    std: tuple[float, ...] = SIGLIP_STD,
) -> str:
    """Hex SHA-256 over the original bytes, the preprocessing options and the encoder fingerprint.

    Each part is length-prefixed (8 bytes, little endian), so no two different inputs
    concatenate to the same stream.
    """
    options = json.dumps(
        {
            "detail": detail,
            "max_dimension_px": int(max_dimension_px),
            "low_detail_max_dimension_px": int(low_detail_max_dimension_px),
            "mean": [float(m) for m in mean],
            "std": [float(s) for s in std],
            "recipe": dr.__version__,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    h = hashlib.sha256()
    for part in (_KEY_DOMAIN, data, options, encoder_fingerprint.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _rejected(err: Exception, max_dimension_px: int) -> ImageRejected:
    kind = str(getattr(err, "kind", "")) or type(err).__name__
    hint = _HINTS.get(kind)
    if hint is None:
        return ImageRejected(f"the image was rejected ({kind}): {err}", kind)
    return ImageRejected(hint.format(max_px=max_dimension_px), kind)


def _decode_rgb(encoded: bytes, width: int, height: int) -> np.ndarray:
    """The recipe's output bytes (WebP) -> uint8 ``[height, width, 3]``."""
    from PIL import Image

    with Image.open(io.BytesIO(encoded)) as im:
        rgb = np.array(im.convert("RGB"), dtype=np.uint8)  # a writable copy
    if rgb.shape != (height, width, 3):
        raise RuntimeError(
            f"deepseek-recipe reported {width}x{height} px but its output decodes to "
            f"{rgb.shape[1]}x{rgb.shape[0]}"
        )
    return rgb


def pixels_of(
    encoded: bytes,
    width: int,
    height: int,
    mean: tuple[float, ...] = SIGLIP_MEAN,
    std: tuple[float, ...] = SIGLIP_STD,
) -> torch.Tensor:
    """The recipe's preprocessed bytes (``ImageInfo.data``, WebP, ``width`` x ``height``) ->
    normalised float32 pixels ``[3, height, width]``."""
    rgb = _decode_rgb(encoded, width, height)
    # (x / 255 - mean) / std as one multiply-add per value: x * (1 / (255 std)) - mean / std
    scale = torch.tensor([1.0 / (255.0 * s) for s in std]).view(3, 1, 1)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)]).view(3, 1, 1)
    return torch.from_numpy(rgb).permute(2, 0, 1).contiguous().to(torch.float32).mul_(scale).add_(shift)


def prepare(
    data: bytes,
    detail: str,
    max_dimension_px: int,
    low_detail_max_dimension_px: int,
    encoder_fingerprint: str = "",
    *,
    mean: tuple[float, ...] = SIGLIP_MEAN,
    std: tuple[float, ...] = SIGLIP_STD,
) -> PreparedImage:
    """Preprocess encoded image ``data`` (webp, png, jpeg or gif) for the vision encoder.

    ``detail`` is one of `DETAILS`; ``max_dimension_px`` bounds each side of the *input*
    image (larger is rejected); ``low_detail_max_dimension_px`` bounds the resized image of a
    ``"low"`` request. ``mean``/``std`` must be the encoder's (``VisionConfig.image_mean`` /
    ``image_std``). Raises `ImageRejected` for any image the recipe refuses.
    """
    if detail not in DETAILS:
        raise ImageRejected(
            f"unknown image detail {detail!r}; use one of {', '.join(DETAILS)}", "InvalidDetail"
        )
    options = dr.PreprocessOptions(detail, max_dimension_px, low_detail_max_dimension_px)  # type: ignore[arg-type]
    try:
        info = dr.OpenCvImagePreprocessor().preprocess(bytes(data), options)
        num_tokens = dr.MultiModalData([info]).image_token_adjustment() + 1
    except (dr.ImageError, dr.CalcResizeError) as err:
        raise _rejected(err, max_dimension_px) from err
    pixels = pixels_of(info.data, info.width, info.height, mean, std)
    key = image_key(
        data, detail, max_dimension_px, low_detail_max_dimension_px, encoder_fingerprint, mean, std
    )
    return PreparedImage(pixels, info.width, info.height, num_tokens, detail, key)
