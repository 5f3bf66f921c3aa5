"""What a client may send hoping that something on the way rewrites it (issue 28): shared by the
unit tests of the path decision and the integration test against the real vLLM."""

from __future__ import annotations

import http.client


def call(port: int, method: str, target: str, body: bytes = b"",
         headers: dict[str, str] | None = None, timeout: float = 60.0
         ) -> tuple[int, dict[str, str], bytes]:
    """One request on 127.0.0.1 with the target sent as written (http.client neither
    normalises nor quotes it): status, headers (lower-case names), body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        for k, v in {"Content-Length": str(len(body)), "Content-Type": "application/json",
                     **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def spellings(path: str) -> list[str]:
    """Ways a client may write ``path`` hoping that something on the way rewrites it."""
    name = path.lstrip("/")
    head, _, tail = name.rpartition("/")
    enc = "".join(f"%{ord(c):02x}" for c in name[:2]) + name[2:]
    out = [
        path, f"/.{path}", f"/./{name}", f"/v1/..{path}", f"/v1/%2e%2e{path}", f"/%2e{path}",
        f"/v1/%2E%2E{path}", f"//{name}", f"{path}/", f"{path}//", f"/{enc}",
        f"/{name.upper()}", f"{path}?mode=abort", f"/./{name}?level=1", f"/x/../{name}",
        f"/v1%2f..%2f{name}", f"/v1/..%2f{name}", f"/v1\\..\\{name}", f"/{name}%00",
        f"/{name}#frag", f"http://127.0.0.1{path}", f"/{name}%2",
        f"/%252e%252e{path}", f"/v1/./../{name}", f"{path};x", f"{path}/.",
    ]
    if head:
        out.append(f"/{head}//{tail}")
    return out
