import pytest

from services.api.errors import ApiError
from services.api.image_headers import image_dimensions
from services.api.images import (
    ImageLimits,
    check_image_bytes,
    check_remote_url,
    decode_data_url,
    is_public_address,
)
from tests.unit.api.images_fixtures import data_url, gif_header, jpeg_header, png

LIMITS = ImageLimits(
    max_images=4, max_image_bytes=64 * 1024, max_image_pixels=1_000_000, max_image_side_px=4096,
    allow_remote_images=False, allow_hosts=(),
)  # fmt: skip


def test_header_dimensions_of_each_format():
    assert image_dimensions(png(7, 5)) == (7, 5)
    assert image_dimensions(jpeg_header(640, 480)) == (640, 480)
    assert image_dimensions(gif_header(3, 9)) == (3, 9)
    assert image_dimensions(b"not an image at all") is None
    assert image_dimensions(png(7, 5)[:20]) is None  # truncated header


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = png(50_000, 50_000)  # 2.5 gigapixels declared in ~60 bytes
    assert len(bomb) < 200
    with pytest.raises(ApiError) as exc:
        check_image_bytes(bomb, LIMITS, "messages[0]")
    assert exc.value.status == 400 and exc.value.param in ("max_image_pixels", "max_image_side_px")
    with pytest.raises(ApiError) as exc:
        check_image_bytes(jpeg_header(4000, 4000), LIMITS, "x")  # 16 MP, sides within bounds
    assert exc.value.param == "max_image_pixels"


def test_data_url_size_is_checked_before_decoding():
    big = "data:image/png;base64," + "A" * (LIMITS.max_image_bytes * 2)
    with pytest.raises(ApiError) as exc:
        decode_data_url(big, LIMITS, "img")
    assert exc.value.param == "max_image_bytes"
    assert decode_data_url(data_url(png(2, 2)), LIMITS, "img") == png(2, 2)
    with pytest.raises(ApiError):
        decode_data_url("data:image/png;base64,@@@@", LIMITS, "img")


def test_remote_urls_off_by_default_and_private_addresses_refused_when_on():
    with pytest.raises(ApiError) as exc:
        check_remote_url("https://example.com/a.png", LIMITS, "img")
    assert exc.value.param == "allow_remote_images"
    on = ImageLimits(**{**LIMITS.__dict__, "allow_remote_images": True, "allow_hosts": ("localhost",)})
    with pytest.raises(ApiError) as exc:
        check_remote_url("https://other.example/a.png", on, "img")
    assert exc.value.param == "image_url_allow_hosts"
    with pytest.raises(ApiError) as exc:  # allow-listed, but resolves to loopback
        check_remote_url("http://localhost:8000/a.png", on, "img")
    assert "private, loopback" in exc.value.message
    with pytest.raises(ApiError):
        check_remote_url("file:///etc/passwd", on, "img")


@pytest.mark.parametrize(
    "address,public",
    [("8.8.8.8", True), ("127.0.0.1", False), ("10.1.2.3", False), ("192.168.0.1", False),
     ("169.254.169.254", False), ("::1", False), ("::ffff:127.0.0.1", False), ("0.0.0.0", False),
     ("fd00::1", False), ("2606:4700:4700::1111", True), ("bogus", False)],
)  # fmt: skip
def test_address_filter(address, public):
    assert is_public_address(address) is public
