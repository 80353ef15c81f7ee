"""multipart/form-data bodies as OpenAI's upload routes get them: what the openai client's HTTP
library (httpx2) encodes parses back part by part, byte for byte; malformed
bodies are refused with a message saying what is wrong."""

import httpx2  # the HTTP library of the openai client (the dev extra)
import pytest

from torchtitan_speechlm.serving.multipart import MultipartError, boundary_of, parse_multipart

CT = "multipart/form-data; boundary=XyZ"


def body(*parts: bytes, close: bool = True) -> bytes:
    out = b"".join(b"--XyZ\r\n" + p + b"\r\n" for p in parts)
    return out + (b"--XyZ--\r\n" if close else b"")


def test_what_httpx_encodes_parses_back_exactly():
    audio = bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n"  # binary, CRLFs, dashes
    req = httpx2.Request(
        "POST",
        "http://x/v1/audio/transcriptions",
        data={"model": "m", "response_format": "text"},
        files={"file": ("speech.wav", audio, "audio/wav")},
    )
    parts = parse_multipart(req.read(), req.headers["content-type"])
    assert set(parts) == {"model", "response_format", "file"}
    assert parts["file"].data == audio
    assert (parts["file"].filename, parts["file"].content_type) == ("speech.wav", "audio/wav")
    assert parts["model"].text() == "m" and parts["model"].filename is None
    assert parts["response_format"].text() == "text"


def test_quoted_boundary_preamble_epilogue_and_repeated_names():
    ct = 'multipart/form-data; boundary="XyZ"'
    data = (
        b"preamble\r\n"
        + body(
            b'Content-Disposition: form-data; name="a"\r\n\r\nfirst',
            b'Content-Disposition: form-data; name="a"\r\n\r\nsecond',
            b'Content-Disposition: form-data; name="empty"\r\n\r\n',
        )
        + b"epilogue"
    )
    parts = parse_multipart(data, ct)
    assert parts["a"].text() == "first"  # a repeated name: its first part
    assert parts["empty"].data == b""


@pytest.mark.parametrize(
    "content_type, data, message",
    [
        ("application/json", b"{}", "expected a multipart/form-data body"),
        ("", b"", "expected a multipart/form-data body"),
        ("multipart/form-data", b"--XyZ--", "no valid boundary"),
        (CT, b"no boundary in here", "does not contain the boundary"),
        (CT, body(b'Content-Disposition: form-data; name="a"\r\n\r\nx', close=False),
         "truncated"),
        (CT, body(b'Content-Disposition: form-data; name="a"'), "no blank line"),
        (CT, body(b"Content-Type: text/plain\r\n\r\nx"), "Content-Disposition: form-data"),
        (CT, body(b"Content-Disposition: form-data\r\n\r\nx"), "no field name"),
        (CT, b"--XyZgarbage\r\n--XyZ--", "not followed by a line break"),
    ],
)  # fmt: skip
def test_malformed_bodies_are_refused_with_the_reason(content_type, data, message):
    with pytest.raises(MultipartError, match=message):
        parse_multipart(data, content_type)


def test_boundary_of():
    assert boundary_of("multipart/form-data; boundary=abc; charset=utf-8") == "abc"
    with pytest.raises(MultipartError):
        boundary_of("multipart/form-data; boundary=" + "a" * 71)
