"""Image content parts and image decoding (sync, no MLX); model kind detection."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from mlxd.actors.engine.scheduler.types import model_kind
from mlxd.actors.vision import ImageLimits, VisionError, load_image, load_images, split_images
from mlxd.protocol.messages import ImagePart, TextPart
from mlxd.scripts.tiny_models import data_url, png

LIMITS = ImageLimits(
    max_images=2,
    max_image_bytes=50_000,
    max_image_pixels=200 * 200,
    allow_remote_urls=False,
    remote_timeout_s=2.0,
)


def flat_png(width, height, mode="RGB") -> bytes:
    """A one-colour PNG: a few kilobytes however many pixels."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def image_part(url):
    return ImagePart(url=url)


def test_model_kind_comes_from_the_config_not_the_name():
    assert model_kind({"model_type": "qwen2_vl", "vision_config": {"depth": 2}}) == "vision"
    assert model_kind({"model_type": "qwen2_vl"}) == "text"  # the name says nothing
    assert model_kind({"model_type": "llama", "vision_config": {}}) == "text"
    assert model_kind({"model_type": "x", "vision_config": {"depth": 2}}, "text") == "text"
    assert model_kind({"model_type": "llama"}, "vision") == "vision"
    with pytest.raises(ValueError, match="kind"):
        model_kind({}, "audio")


def test_split_images_keeps_prompt_order_and_flattens_text_only_content():
    messages = [
        {"role": "system", "content": [TextPart(text="Be brief.")]},
        {"role": "user", "content": [image_part("data:a"), TextPart(text="and")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [TextPart(text="x"), image_part("data:b")]},
    ]
    out, sources = split_images(messages)
    assert sources == ["data:a", "data:b"]
    assert out[0]["content"] == "Be brief."
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}]
    assert out[3]["content"] == [{"type": "text", "text": "x"}, {"type": "image"}]


def test_an_image_part_without_a_url_is_an_error():
    with pytest.raises(VisionError):
        split_images([{"role": "user", "content": [ImagePart(url="")]}])


def test_data_url_decodes_to_rgb():
    image = load_image(data_url(png(40, 30)), LIMITS)
    assert image.size == (40, 30)
    assert image.mode == "RGB"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (data_url(b"not an image at all"), "cannot decode"),
        (data_url(png()[:60]), "cannot decode"),  # truncated
        ("data:image/png;base64,@@@@", "base64"),
        ("data:image/png,rawbytes", "base64"),
        (data_url(flat_png(300, 300)), "pixels"),  # 90,000 > 40,000, refused before decoding
        (data_url(flat_png(10_000, 10_000, "1")), "pixels"),  # a decompression bomb
        # past twice PIL's own bomb limit, PIL itself refuses it while reading the header
        (data_url(flat_png(20_000, 20_000, "1")), "cannot decode"),
        (data_url(png(400, 400, seed=1)), "bytes"),
        ("file:///etc/passwd", "data: or http"),
        ("http://127.0.0.1:9/x.png", "disabled"),
    ],
)
def test_bad_images_are_errors(url, message):
    with pytest.raises(VisionError, match=message):
        load_image(url, LIMITS)


def test_image_count_is_limited_and_errors_name_the_image():
    good = data_url(png())
    assert len(load_images([good, good], LIMITS)) == 2
    with pytest.raises(VisionError, match="at most 2 images"):
        load_images([good] * 3, LIMITS)
    with pytest.raises(VisionError, match="image 2: cannot decode"):
        load_images([good, data_url(b"junk")], LIMITS)


def _serve(body: bytes):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_remote_urls_when_allowed_with_a_size_cap():
    allowed = ImageLimits(2, 50_000, 200 * 200, True, 2.0)
    server = _serve(png(20, 10))
    try:
        url = f"http://127.0.0.1:{server.server_port}/a.png"
        assert load_image(url, allowed).size == (20, 10)
        with pytest.raises(VisionError, match="disabled"):
            load_image(url, LIMITS)
    finally:
        server.shutdown()
    big = _serve(png(190, 190, seed=3))  # > 50,000 bytes of noise
    try:
        with pytest.raises(VisionError, match="larger than"):
            load_image(f"http://127.0.0.1:{big.server_port}/b.png", allowed)
    finally:
        big.shutdown()
    with pytest.raises(VisionError, match="could not fetch"):
        load_image("http://127.0.0.1:9/nothing.png", allowed)
