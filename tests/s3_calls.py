"""Watch the requests an s3fs filesystem sends, for tests (and benchmarks) that count or check
them: botocore's ``before-call`` event, hooked for the length of a ``with`` block."""

from __future__ import annotations

from typing import Any

__all__ = ["S3Calls"]


class S3Calls:
    """``on_call(model, params)`` for every S3 request ``fs`` sends inside the ``with`` block:
    the botocore operation model (``model.name``: "GetObject", "UploadPart", ...) and the
    request's parameters (``url_path``, ``headers``, ``body``). Subclasses record what they
    need in ``on_call``; the hook is removed on the way out, also after a failure."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def on_call(self, model: Any, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def _hook(self, model: Any, params: dict[str, Any], **_: Any) -> None:
        self.on_call(model, params)

    def __enter__(self):
        self.fs.connect()  # the client must exist before it can be hooked
        self.fs.s3.meta.events.register("before-call.s3", self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self.fs.s3.meta.events.unregister("before-call.s3", self._hook)
