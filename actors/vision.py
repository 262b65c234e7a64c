"""Images in chat requests: content parts → template parts, image bytes → processor inputs.

Runs in the tokenizer actor's worker threads, never on the event loop and never
on the generation thread. ``split_images`` turns normalized messages into what a
vision chat template expects (``{"type": "image"}`` parts, text parts) and lists
the image sources in prompt order; ``load_image`` decodes one source (a ``data:``
URL, or an ``http(s)`` URL when the settings allow it) under the byte and pixel
limits; ``VisionProcessor`` runs the model's processor and hands back plain numpy
arrays. Any problem with an image is a ``VisionError``: a 400 for that request.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from mlxd.actors.tools import template_source
from mlxd.protocol.messages import ImagePart


class VisionError(ValueError):
    """An image (or image part) that cannot be used; becomes an HTTP 400."""


@dataclass(frozen=True)
class ImageLimits:
    """What bounds one request's images (the supervisor maps ``[vision]`` onto it)."""

    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    allow_remote_urls: bool
    remote_timeout_s: float


# ---- content parts ---------------------------------------------------------------------


def _image_url(part: ImagePart) -> str:
    if not part.url:
        raise VisionError("an image_url part needs image_url.url (a data: or http(s) URL)")
    return part.url


def _template_content(content: Any, sources: list[str]) -> Any:
    """One message's content for the template; image URLs are appended to ``sources``."""
    if not isinstance(content, list):
        return content
    parts: list[dict] = []
    for part in content:
        if isinstance(part, ImagePart):
            sources.append(_image_url(part))
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": part.text})
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)  # renders as a text model's would
    return parts


def split_images(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """Template-ready messages (normalized, their content parts typed) and the image
    sources in the order the prompt uses them: each image part becomes the template's
    ``{"type": "image"}``, each text part ``{"type": "text", "text": ...}``."""
    sources: list[str] = []
    out = [{**m, "content": _template_content(m.get("content"), sources)} for m in messages]
    return out, sources


# ---- image bytes -----------------------------------------------------------------------


def _data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise VisionError("data: image URLs must be base64 (data:image/...;base64,...)")
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
        raise VisionError(
            f"image is larger than {limits.max_image_bytes} bytes (vision.max_image_bytes)"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise VisionError(f"image is not valid base64: {exc}") from exc


def _remote_bytes(url: str, limits: ImageLimits) -> bytes:
    if not limits.allow_remote_urls:
        raise VisionError("remote image URLs are disabled here (vision.allow_remote_urls)")
    try:
        with urllib.request.urlopen(url, timeout=limits.remote_timeout_s) as response:  # noqa: S310
            data = response.read(limits.max_image_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise VisionError(f"could not fetch image {url!r}: {exc}") from exc
    return data


def image_bytes(url: str, limits: ImageLimits) -> bytes:
    if url.startswith("data:"):
        data = _data_url_bytes(url, limits)
    elif url.startswith(("http://", "https://")):
        data = _remote_bytes(url, limits)
    else:
        raise VisionError("image URLs must be data: or http(s) URLs")
    if len(data) > limits.max_image_bytes:
        raise VisionError(
            f"image is larger than {limits.max_image_bytes} bytes (vision.max_image_bytes)"
        )
    return data


def decode_image(data: bytes, limits: ImageLimits) -> Any:
    """A PIL RGB image; the pixel count is checked from the header, before decoding."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise VisionError(
                    f"image is {width}x{height}; the limit is {limits.max_image_pixels} pixels "
                    "(vision.max_image_pixels)"
                )
            image.load()
            return image.convert("RGB")
    except VisionError:
        raise
    except (
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombWarning,
        Image.DecompressionBombError,
    ) as exc:
        raise VisionError(f"cannot decode image: {exc}") from exc


def load_image(url: str, limits: ImageLimits) -> Any:
    return decode_image(image_bytes(url, limits), limits)


def load_images(sources: list[str], limits: ImageLimits) -> list[Any]:
    if len(sources) > limits.max_images:
        raise VisionError(
            f"at most {limits.max_images} images per request (vision.max_images; "
            f"{len(sources)} given)"
        )
    images = []
    for i, url in enumerate(sources, 1):
        try:
            images.append(load_image(url, limits))
        except VisionError as exc:
            raise VisionError(f"image {i}: {exc}") from exc
    return images


# ---- the model's processor -------------------------------------------------------------


class VisionProcessor:
    """The model's processor: chat template, image preprocessing, image-token expansion."""

    def __init__(self, processor: Any):
        self.processor = processor

    def render(self, messages: list[dict], extra: dict[str, Any] | None = None) -> str:
        """The whole conversation through the processor's chat template.

        ``extra`` holds the template variables (``tools``, ``chat_template_kwargs``
        such as ``enable_thinking``), passed as a text model's tokenizer gets them.
        """
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self._used(extra or {})
        )

    def _used(self, extra: dict[str, Any]) -> dict[str, Any]:
        """The variables the template mentions: a processor logs a misleading warning per
        request for each other one (a text model's tokenizer ignores them silently)."""
        source = template_source(self.processor) + template_source(self.processor.tokenizer)
        return {k: v for k, v in extra.items() if k in source} if source else extra

    def encode(self, prompt: str, images: list[Any]) -> tuple[list[int], dict[str, np.ndarray]]:
        """Token ids (image placeholders expanded) and the image arrays, as numpy."""
        out = self.processor(text=[prompt], images=images, add_special_tokens=False)
        # mlx-vlm processors wrap their numpy output in (host) MLX arrays: take
        # numpy back at once so that only numpy crosses to the generation actor.
        arrays = {k: np.asarray(v) for k, v in out.items() if v is not None}
        ids = arrays.pop("input_ids")[0].tolist()
        arrays.pop("attention_mask", None)
        return ids, arrays
