"""Grader URLs compared as URLs, not as strings.

The admin's allow-list (`GRPO_REWARD_URLS`) names where an `http` reward may send completions and
the grader secret. A string prefix is not enough: `/ok/../other` leaves `/ok/`, and in
`http://allowed:80@elsewhere/` the allowed part is userinfo. So every URL, the allow-list's own
entries included, is parsed into one canonical form (`GraderUrl`) and compared part by part:

- scheme http or https; a host of letters, digits, dots and dashes or an IP literal, lowercased;
  the port, the scheme's default when absent, must equal the entry's;
- no userinfo, no fragment, no backslash, no control characters or spaces;
- the path percent-decoded once (a `%` left after that is double encoding: refused), then its dot
  segments resolved; it must be the entry's path or lie under it on a segment boundary
  (`/ok` allows `/ok` and `/ok/x`, never `/okay`).

The canonical form is what the worker sends, so what was checked is what is called. Never imports
torch or FastAPI: the API checks at submit time and the worker before every request.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
_UNSAFE = re.compile(r"[\x00-\x20\x7f\\]")  # control characters, space and backslash
# Cloud metadata services: never a grader unless the allow-list names the address itself.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16"))


class UrlRefused(ValueError):
    """Why a URL may not be called, in words for the user."""


@dataclass(frozen=True)
class GraderUrl:
    scheme: str  # http | https
    host: str  # lowercased name or IP literal (IPv6 without brackets)
    port: int  # explicit or the scheme's default
    path: str  # decoded once, dot segments resolved, starts with "/"
    query: str  # as given ("" for none)

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    def __str__(self) -> str:
        path = quote(self.path, safe="/:@!$&'()*+,;=-._~")
        return f"{self.scheme}://{self.netloc}{path}" + (f"?{self.query}" if self.query else "")

    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The host as an address when it is an IP literal."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    def under(self, entry: GraderUrl) -> bool:
        """Same scheme, host and port as `entry`, and the path equal to or below entry's."""
        if (self.scheme, self.host, self.port) != (entry.scheme, entry.host, entry.port):
            return False
        prefix = entry.path if entry.path.endswith("/") else entry.path + "/"
        return self.path == entry.path or self.path.startswith(prefix)


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4 for an absolute path: `/a/./b/../c/` -> `/a/c/`."""
    out: list[str] = []
    segments = path.split("/")[1:]
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        elif seg == ".":
            if last:
                out.append("")
        else:
            out.append(seg)
    return "/" + "/".join(out)


def parse_url(url: str) -> GraderUrl:
    """The canonical form of `url`, or UrlRefused saying what is wrong with it."""
    if not url.isascii():
        raise UrlRefused("must be ASCII (percent-encode the path; use the IDNA form of a host name)")
    if _UNSAFE.search(url):
        raise UrlRefused("must not contain spaces, control characters or backslashes")
    if "#" in url:
        raise UrlRefused("must not have a fragment (#...)")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise UrlRefused("must be an http:// or https:// URL")
    if "@" in parts.netloc:
        raise UrlRefused("must not carry userinfo (user:password@): the grader secret comes from the workers")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise UrlRefused("must name a host")
    try:
        port = parts.port or DEFAULT_PORTS[scheme]
    except ValueError:
        raise UrlRefused("has a port that is not a number from 1 to 65535") from None
    if port == 0:
        raise UrlRefused("has a port that is not a number from 1 to 65535")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        # a last label that starts with a digit is an address in inet_aton's forms (127.1, 0x7f.0.0.1)
        if parts.netloc.startswith("[") or not _HOST_NAME.match(host) or not host.rsplit(".", 1)[-1][0].isalpha():
            raise UrlRefused(f"has a host that is neither a DNS name nor an IP address: {host!r:.80}") from None
    path = unquote(parts.path or "/", errors="strict")
    if "%" in path:
        raise UrlRefused("has a path that is percent-encoded twice (a % is left after decoding once)")
    if _UNSAFE.search(path):
        raise UrlRefused("has a path that decodes to spaces, control characters or backslashes")
    if not path.startswith("/"):
        path = "/" + path
    return GraderUrl(scheme=scheme, host=host, port=port, path=_remove_dot_segments(path), query=parts.query)


def parse_allow_list(entries: list[str], setting: str = "GRPO_REWARD_URLS") -> list[GraderUrl]:
    """The admin's entries in canonical form; ValueError naming a bad one (a configuration error)."""
    out = []
    for e in entries:
        try:
            entry = parse_url(e)
        except UrlRefused as exc:
            raise ValueError(f"{setting} entry {e!r}: {exc}") from None
        if entry.query:
            raise ValueError(f"{setting} entry {e!r}: an allow-list entry has no query")
        out.append(entry)
    return out


def forbidden_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an address is no grader's (link-local, a cloud metadata service), or None."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_unspecified or ip.is_multicast:
        return "not a host's address"
    return None


def check_url(url: str, allow_list: list[GraderUrl], setting: str = "GRPO_REWARD_URLS",
              what: str = "http rewards") -> GraderUrl:
    """The canonical URL when it lies under an allow-list entry; UrlRefused otherwise."""
    parsed = parse_url(url)
    if not any(parsed.under(e) for e in allow_list):
        shown = ", ".join(map(str, allow_list)) or f"none: this deployment allows no {what}"
        raise UrlRefused(f"is not on the admin's allow-list ({setting}: {shown}); compared as "
                         f"{parsed} by scheme, host, port and path")
    return parsed


def resolve_address(url: GraderUrl) -> str:
    """The one address a request to `url` connects to: the IP literal, or the host's first address,
    checked (UrlRefused: a link-local or metadata address; OSError: the lookup failed)."""
    if (ip := url.ip()) is not None:
        return str(ip)
    infos = socket.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM)
    ip = ipaddress.ip_address(infos[0][4][0])
    check_address(url, ip)
    return str(ip)


def check_address(url: GraderUrl, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    """UrlRefused when the address a host name resolved to is link-local or a metadata service.

    An entry that names such an address as an IP literal allows it (`under` matched that very host):
    an admin may allow one, a DNS name can never lead there by accident."""
    if url.ip() is None and (why := forbidden_address(ip)):
        raise UrlRefused(f"may not be called: {url.host} resolves to {ip}, {why}")
