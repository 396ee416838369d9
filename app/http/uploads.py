"""The HTTP side of ``/translate_file`` and ``/download_file``: the upload read in memory
(``read_upload``: streamed, stopped at the file limit, nothing spooled to disk, unlike a
form FastAPI parses), the client admitted as every route admits it, the download answered.

No name or path the client sends reaches a filesystem: the upload's file name only chooses
the format (``app.formats.documents``) and, sanitized, the download's Content-Disposition; results
are kept in memory (``app.storage.files.FileStore``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from app.formats.documents import FORMATS
from app.http.deps import check_api_key
from app.http.schemas import ErrorResponse
from app.serving.errors import BAD_REQUEST, ApiError
from app.serving.state import AppState
from app.storage.files import StoredFile
from app.storage.ratelimit import client_id

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

MAX_FIELD_BYTES = 4096  # source, target, api_key: short
MAX_PARTS = 16
FORM_OVERHEAD = 64 * 1024  # what a multipart body may hold besides the file (boundaries, fields)


@dataclass(frozen=True)
class Upload:
    """A multipart upload: the ``file`` part (its name as the client gave it) and the fields."""

    filename: str | None
    data: bytes
    fields: dict[str, str]

    def field(self, name: str) -> str:
        value = self.fields.get(name, "").strip()
        if not value:
            raise ApiError(BAD_REQUEST, "validation_error", f"{name}: Field required")
        return value


@dataclass
class _Parts:
    """python-multipart's callbacks, collecting the parts within their limits."""

    max_file_bytes: int
    fields: dict[str, str] = field(default_factory=dict)
    file: bytes | None = None
    filename: str | None = None
    count: int = 0
    _name: str = ""
    _filename: str | None = None
    _data: bytearray = field(default_factory=bytearray)
    _header: bytes = b""
    _value: bytes = b""
    _disposition: bytes = b""

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self.begin,
            "on_header_field": self.header_field,
            "on_header_value": self.header_value,
            "on_header_end": self.header_end,
            "on_headers_finished": self.headers_finished,
            "on_part_data": self.data,
            "on_part_end": self.end,
        }

    def begin(self) -> None:
        self.count += 1
        if self.count > MAX_PARTS:
            raise ApiError(BAD_REQUEST, "invalid_multipart", f"more than {MAX_PARTS} parts in the form")
        self._data, self._disposition, self._filename = bytearray(), b"", None

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            self._disposition = self._value
        self._header, self._value = b"", b""

    def headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise ApiError(BAD_REQUEST, "invalid_multipart", "a form part has no name")
        self._name = options[b"name"].decode("utf-8", "replace")
        given = options.get(b"filename")
        self._filename = given.decode("utf-8", "replace") if given is not None else None
        if self._name == "file" and self.file is not None:
            raise ApiError(BAD_REQUEST, "invalid_multipart", "file: one file per request")

    def data(self, data: bytes, start: int, end: int) -> None:
        limit = self.max_file_bytes if self._name == "file" else MAX_FIELD_BYTES
        if len(self._data) + end - start > limit:
            if self._name == "file":
                raise ApiError(413, "file_too_large", f"file: larger than {limit} bytes")
            raise ApiError(BAD_REQUEST, "invalid_multipart", f"{self._name}: longer than {limit} bytes")
        self._data += data[start:end]

    def end(self) -> None:
        if self._name == "file":
            self.file, self.filename = bytes(self._data), self._filename
            return
        try:
            self.fields[self._name] = self._data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(BAD_REQUEST, "invalid_unicode", f"{self._name}: not UTF-8 text") from None


async def read_upload(request: Request, max_file_bytes: int) -> Upload:
    """The multipart body, read chunk by chunk into memory and stopped at ``max_file_bytes``
    of file (413 ``file_too_large``); 415 for another media type, 400 for a broken form. The
    query string's parameters under the form's, as for every route (``app.http.deps.read_body``)."""
    kind, params = parse_options_header(request.headers.get("content-type"))
    if kind != b"multipart/form-data" or not params.get(b"boundary"):
        raise ApiError(415, "unsupported_media_type", "send multipart/form-data with the document as `file`")
    parts = _Parts(max_file_bytes)
    try:
        parser = MultipartParser(params[b"boundary"], parts.callbacks())
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except (FormParserError, ValueError) as err:
        raise ApiError(BAD_REQUEST, "invalid_multipart", f"the form could not be read: {err}") from None
    if parts.file is None:
        raise ApiError(BAD_REQUEST, "validation_error", "file: Field required")
    if not parts.filename:
        raise ApiError(BAD_REQUEST, "unsupported_file_format", "file: no file name (its extension names the format)")
    return Upload(parts.filename, parts.file, {**request.query_params, **parts.fields})  # as LibreTranslate reads


async def admit(request: Request, state: AppState, key: str | None, upload: Upload) -> str:
    """As ``app.http.deps.body`` admits a request: the form's ``api_key`` when no header gave one
    (403), then the client's rate limits (429). The client's id."""
    settings = state.settings
    if key is None:
        key = upload.fields.get("api_key") or None
        check_api_key(key, settings)
    address = request.client.host if request.client else None
    client = client_id(key if key in settings.known_keys else None, address)
    await state.rate_limiter.hit(client)
    return client


def download(stored: StoredFile) -> Response:
    """The stored file as an attachment under its (sanitized) name."""
    fallback = stored.filename.encode("ascii", "replace").decode().replace("?", "_")
    disposition = f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(stored.filename)}"
    headers = {
        "Content-Disposition": disposition,
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "sandbox",  # an .html result is the client's own page: never run it here
        "Cache-Control": "private, no-store",
    }
    return Response(stored.data, media_type=stored.media_type, headers=headers)


def upload_body(translate: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of /translate_file: its multipart form, ``source`` and ``target``
    as /translate states them (``translate``, the request model with this server's languages)."""
    languages = translate.model_json_schema()["properties"]
    schema = {
        "type": "object",
        "required": ["file", "source", "target"],
        "properties": {
            "file": {
                "type": "string",
                "format": "binary",
                "description": f"the document, {' '.join(FORMATS)} (by its name; the content must match)",
            },
            "source": {**languages["source"], "description": 'the document\'s language, or "auto" to detect it'},
            "target": languages["target"],
            "api_key": {"type": "string", "description": "API key (unless the X-API-Key header gives one)"},
        },
    }
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


DOWNLOAD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the translated file, as an attachment",
        "content": {
            f.media_type.split(";")[0]: {"schema": {"type": "string", "format": "binary"}} for f in FORMATS.values()
        },
    },
    404: {"model": ErrorResponse, "description": "no such file (expired, or never made here)"},
}
