"""Images for the V4.1 prompt: preprocessing (deepseek-recipe) into encoder-ready pixels.

`prepare` turns encoded image bytes into a `PreparedImage` (normalised pixels, the recipe's
token count and a content key); `engine.model.vision.VisionEncoder` turns its pixels into
exactly ``num_tokens`` embedding rows. See docs/vision.md.
"""

from engine.vision.preprocess import (
    DETAILS,
    SIGLIP_MEAN,
    SIGLIP_STD,
    ImageRejected,
    PreparedImage,
    image_key,
    pixels_of,
    prepare,
)

__all__ = [
    "DETAILS",
    "SIGLIP_MEAN",
    "SIGLIP_STD",
    "ImageRejected",
    "PreparedImage",
    "image_key",
    "pixels_of",
    "prepare",
]
