"""uvicorn's own answer to a request it cannot parse (a bad request line, bad headers) is a
text/plain 400 written before any application code runs. This protocol class answers it with
the OpenAI error body instead, so every client error has the same shape."""

from __future__ import annotations

import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol


class JSONErrorsProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "bad_http"}}).encode()
        head = [b"HTTP/1.1 400 Bad Request"]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json", b"content-length: %d" % len(body),
                 b"connection: close"]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.transport.close()
