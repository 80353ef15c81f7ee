"""``multipart/form-data`` bodies (RFC 7578), parsed without the deprecated ``cgi`` module: the
boundary from the Content-Type header, each part's headers through ``email.parser``, its body
as bytes. Enough for OpenAI's upload routes (a ``file`` part and a few text fields)."""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message
from email.parser import BytesHeaderParser
from email.utils import collapse_rfc2231_value


class MultipartError(ValueError):
    """The body is not a well-formed multipart/form-data body; the message says why."""


@dataclass
class Part:
    name: str
    data: bytes
    filename: str | None = None
    content_type: str = "text/plain"

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def boundary_of(content_type: str) -> str:
    """The boundary of a ``multipart/form-data; boundary=...`` Content-Type header."""
    msg = Message()
    msg["content-type"] = content_type or ""
    if msg.get_content_type() != "multipart/form-data":
        raise MultipartError(
            f"expected a multipart/form-data body, got Content-Type {content_type or 'none'!r}"
        )
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= 70:
        raise MultipartError("the multipart/form-data Content-Type has no valid boundary")
    return boundary


def parse_multipart(body: bytes, content_type: str) -> dict[str, Part]:
    """The parts of a form body by field name (a repeated name: its first part)."""
    delim = b"--" + boundary_of(content_type).encode("latin-1")
    start = body.find(delim)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise MultipartError("the body does not contain the boundary of its Content-Type")
    parts: dict[str, Part] = {}
    segments = body[start + len(delim) :].split(b"\r\n" + delim)
    for i, seg in enumerate(segments):
        if seg.startswith(b"--"):  # the close delimiter: anything after it is the epilogue
            return parts
        if i == len(segments) - 1:
            break  # the last segment must be the close delimiter
        part = _part(seg.lstrip(b" \t"))
        parts.setdefault(part.name, part)
    raise MultipartError("the multipart body is truncated (no closing boundary)")


def _part(seg: bytes) -> Part:
    if not seg.startswith(b"\r\n"):
        raise MultipartError("a multipart boundary is not followed by a line break")
    head, sep, data = seg[2:].partition(b"\r\n\r\n")
    if not sep:
        if seg[2:4] == b"\r\n":  # a part without headers
            head, data = b"", seg[4:]
        else:
            raise MultipartError("a multipart part has no blank line after its headers")
    headers = BytesHeaderParser().parsebytes(head + b"\r\n\r\n")
    if headers.get_content_disposition() != "form-data":
        raise MultipartError("a multipart part has no Content-Disposition: form-data header")
    name = headers.get_param("name", header="content-disposition")
    name = collapse_rfc2231_value(name) if name is not None else ""
    if not name:
        raise MultipartError("a multipart part has no field name")
    return Part(
        name=name,
        data=data,
        filename=headers.get_filename(),
        content_type=headers.get_content_type() if "content-type" in headers else "text/plain",
    )
