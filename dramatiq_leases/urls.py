"""Redis URLs as they may be shown: without their password."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit


def redact_url(url: str) -> str:
    """``url`` with its passwords replaced by ``***``, safe to print.

    The password of the user part, and the value of every query option whose name ends in
    ``password`` (redis-py's ``?password=``, a Sentinel URL's ``?sentinel_password=``). The hosts are
    kept as written, so a URL naming several (``redis+sentinel://h1:26379,h2:26379/...``) stays whole.
    """
    scheme, sep, rest = url.partition("://")
    userinfo = rest.rpartition("@")[0]
    if sep and any(c in userinfo for c in "/?#"):
        # An unencoded "/", "?" or "#" in a password (base64 ones have "/") ends urlsplit's netloc early, and
        # redis-py's error then quotes the whole URL: all up to the last "@" is hidden, the rest redacted as usual.
        tail = redact_url(f"{scheme}://{rest.rpartition('@')[2]}")
        return tail if tail == "<unparsable URL>" else f"{scheme}://***@{tail[len(scheme) + 3 :]}"
    try:
        parts = urlsplit(url)
        userinfo, at, hosts = parts.netloc.rpartition("@")
        if at and ":" in userinfo:
            parts = parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{hosts}")
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        if any(name.lower().endswith("password") for name, _ in pairs):
            parts = parts._replace(
                query=urlencode(
                    [(name, "***" if name.lower().endswith("password") else value) for name, value in pairs], safe="*"
                )
            )
        if parts == urlsplit(url):
            return url
        # Not urlunsplit: it would turn "unix:///path" into "unix:/path".
        return (
            f"{parts.scheme}://{parts.netloc}{parts.path}"
            + (f"?{parts.query}" if parts.query else "")
            + (f"#{parts.fragment}" if parts.fragment else "")
        )
    except ValueError:
        return "<unparsable URL>"
