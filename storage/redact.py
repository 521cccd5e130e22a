"""Keeping credentials out of everything Zephon shows: messages, logs, reprs, catalog rows.

One policy, three shapes of input (and ``secrets_in`` / ``option_secrets``, which collect the
values these would mask, for scrubbing them as literals where they appear out of context):

- ``mask_url``: one URL, with its password and secret-bearing query or fragment values
  replaced by ``***`` (the scheme, host, bucket and path stay, so the message stays useful);
- ``redact``: free text such as a backend's exception message, in which every URL is masked,
  every ``user:password@host``, every secret-looking ``name=value`` / ``"name": "value"``
  pair, and every literal secret the caller knows (from the URL and ``storage_options`` it
  was given: a backend may echo a secret anywhere, e.g. in "Invalid bucket name ...");
- ``redact_options``: a ``storage_options`` mapping for a ``repr``, nested dicts included.

Whether a name is secret is decided by ``is_secret_name`` alone, so options, query strings and
free text agree. It errs towards masking: a masked harmless value costs a little clarity, a
shown secret costs a rotated credential.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, unquote

__all__ = [
    "MASK",
    "environment_secrets",
    "is_secret_name",
    "mask_url",
    "option_secrets",
    "redact",
    "redact_options",
    "secrets_in",
]

MASK = "***"

# A name is secret if it contains one of these (case-insensitive): "key" covers api_key,
# account_key, access_key; "token" covers session_token, sas_token, access_token; "auth" covers
# Authorization headers; "conn...str" covers Azure connection strings, which embed AccountKey.
_SECRET_WORDS = (
    r"key|secret|token|passw|passphrase|pwd|signature|credential|auth|cookie|session|private"
    r"|conn\w*str"
)
_SECRET_NAME = re.compile(rf"{_SECRET_WORDS}|^(?:sig|sas|pw)$", re.I)

#: values of a secret-named option that are modes, not secrets (gcsfs ``token="anon"`` or
#: ``"google_default"``): never scrubbed as literals from the rest of a message
_NOT_SECRET_VALUES = frozenset({"anon", "google_default", "cloud", "browser", "cache", "true"})
#: shorter literals are only masked where a pattern recognises them (after "password=", ...)
_MIN_LITERAL = 6

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_URL_IN_TEXT = re.compile(r"(?<![\w+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
# user:password@host outside a URL (fsspec strips the scheme: s3fs reports the "bucket"
# "KEY:SECRET@bucket"). The password may hold "/" (AWS secrets do), but not start with a
# port number followed by a path, which is host:port/path@x, not a credential.
_BARE_USERINFO = re.compile(
    r"(?<![\w.%+~:/@\-])(?P<user>[\w.%+~\-]+):(?P<pw>(?!/|\d+(?:/|$))[^\s@'\"<>`]+)@(?=[\w.\[\-])"
)
# name=value, "name": "value", name: value and Authorization: Bearer value. An unquoted
# "Name: text" is a pair only if the name is not CamelCase: "NoCredentialsError: Unable to
# locate credentials" and "ExpiredToken: ..." are an exception type or error code and a message.
_PAIR_NAME = rf"(?<![\w.\-])(?:[\w.\-]*(?:{_SECRET_WORDS})[\w.\-]*|sig|sas|pw)"
_PAIR_VALUE = r"""(?:(?:Bearer|Basic|Token|Digest)\s+)?(?:"[^"]*"|'[^']*'|[^\s&,;'"<>)\]}]+)"""
_NOT_CAMEL = r"(?![\w.\-]*?(?-i:[a-z][A-Z]))"
_PAIRS = tuple(
    re.compile(rf"(?P<q>{quote})(?P<name>{name})(?P=q)(?P<sep>{sep})(?P<value>{_PAIR_VALUE})", re.I)
    for quote, name, sep in (
        (r"[\"']?", _PAIR_NAME, r"\s*=\s*"),
        (r"[\"']", _PAIR_NAME, r"\s*:\s*"),
        ("", _NOT_CAMEL + _PAIR_NAME, r"\s*:\s*"),
    )
)
_QUERY_PAIR = re.compile(r"(?P<lead>^|[&;])(?P<name>[^=&;#]+)=(?P<value>[^&;#]*)")


def is_secret_name(name: object) -> bool:
    """Whether an option, query parameter or field of this name holds a credential."""
    return isinstance(name, str) and _SECRET_NAME.search(name) is not None


def _mask_params(params: str, found: set[str] | None = None) -> str:
    """A query string or fragment with secret-named values masked; the rest kept verbatim."""

    def repl(match: re.Match[str]) -> str:
        if not is_secret_name(unquote(match["name"])) or match["value"] in ("", MASK):
            return match[0]
        if found is not None:
            found.add(match["value"])
        return f"{match['lead']}{match['name']}={MASK}"

    return _QUERY_PAIR.sub(repl, params)


def _mask_url(url: str, found: set[str] | None = None) -> str:
    scheme_match = _SCHEME.match(url)
    if scheme_match is None:
        head, rest = "", url
    else:
        head, rest = scheme_match[0], url[scheme_match.end() :]
    scheme = head[:-3].lower()
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if head and "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, colon, password = userinfo.partition(":")
        if colon:
            if password not in ("", MASK) and found is not None:
                found.add(password)
            userinfo = f"{user}:{MASK}"
        elif scheme.endswith(("http", "https", "ws", "wss")):
            # https://<token>@host is how git and many HTTP services take a token
            if user not in ("", MASK) and found is not None:
                found.add(user)
            userinfo = MASK
        rest = f"{userinfo}@{host}{rest[end:]}"
    elif head and ":" in authority:
        # An unencoded "/" in the password ends the authority early: KEY:abc/def@bucket/x
        bare = _BARE_USERINFO.match(rest)
        if bare is not None and "?" not in bare["pw"] and "#" not in bare["pw"]:
            if found is not None:
                found.add(bare["pw"])
            rest = f"{bare['user']}:{MASK}@{rest[bare.end() :]}"
    path, qmark, query = rest.partition("?")
    path, hash_, fragment = path.partition("#") if not qmark else (path, "", "")
    if qmark:
        query, hash_, fragment = query.partition("#")
    masked = path
    if qmark:
        masked += qmark + _mask_params(query, found)
    if hash_:
        masked += hash_ + _mask_params(fragment, found)
    return head + masked


def mask_url(url: str) -> str:
    """``url`` with any password, token-as-user (``https://<token>@host``) and secret-named
    query or fragment value replaced by ``***``; everything else, bucket and path included,
    kept as it was. Plain paths come back unchanged."""
    return _mask_url(str(url))


def _redact(text: str, secrets: Iterable[str], found: set[str] | None) -> str:
    literals = sorted(
        {s for s in secrets if isinstance(s, str) and len(s) >= _MIN_LITERAL}, key=len, reverse=True
    )
    for literal in literals:
        text = text.replace(literal, MASK)
    text = _URL_IN_TEXT.sub(lambda m: _mask_url(m[0], found), text)

    def bare(match: re.Match[str]) -> str:
        if match["pw"] != MASK and found is not None:
            found.add(match["pw"])
        return f"{match['user']}:{MASK}@"

    text = _BARE_USERINFO.sub(bare, text)

    def pair(match: re.Match[str]) -> str:
        value = match["value"]
        quote_char = value[-1] if value[-1] in "'\"" and len(value) > 1 else ""
        scheme = re.match(r"(?:Bearer|Basic|Token|Digest)\s+", value, re.I)
        prefix = scheme[0] if scheme else ""
        inner = value[len(prefix) :].strip("'\"")
        if inner in ("", MASK):
            return match[0]
        if found is not None:
            found.add(inner)
        name = f"{match['q']}{match['name']}{match['q']}"
        return f"{name}{match['sep']}{prefix}{quote_char}{MASK}{quote_char}"

    for pattern in _PAIRS:
        text = pattern.sub(pair, text)
    return text


def redact(text: object, secrets: Iterable[str] = ()) -> str:
    """``str(text)`` with every credential masked: the literal ``secrets`` the caller knows
    (values of at least 6 characters), then URLs (``mask_url``), ``user:password@host`` and
    secret-named ``name=value`` / ``name: value`` / ``"name": "value"`` pairs."""
    return _redact(str(text), secrets, None)


def secrets_in(text: str) -> frozenset[str]:
    """The credential values ``redact`` would mask in ``text`` (and their percent-decoded and
    -encoded forms), plus every secret of ``text`` read as a JSON object of options; for
    scrubbing them as literals from texts that show them out of context."""
    found: set[str] = set()
    _redact(str(text), (), found)
    stripped = str(text).strip()
    if stripped.startswith("{"):
        try:
            options = json.loads(stripped)
        except ValueError:
            options = None
        if isinstance(options, Mapping):
            found |= option_secrets(options)
    return _with_encodings(found)


def option_secrets(options: Mapping[str, Any] | None) -> frozenset[str]:
    """Every string value under a secret-named key of ``storage_options`` (at any depth, e.g.
    ``client_kwargs.aws_secret_access_key``), and the credentials inside its other strings
    (an ``endpoint_url`` with a password)."""
    found: set[str] = set()

    def leaves(value: Any) -> Iterable[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, Mapping):
            for item in value.values():
                yield from leaves(item)
        elif isinstance(value, list | tuple | set | frozenset):
            for item in value:
                yield from leaves(item)

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if is_secret_name(key):
                    for secret in leaves(item):
                        if secret not in _NOT_SECRET_VALUES:
                            # and its parts: an Azure connection string's AccountKey=...
                            found.update({secret, *secrets_in(secret)})
                else:
                    walk(item)
        elif isinstance(value, list | tuple | set | frozenset):
            for item in value:
                walk(item)
        elif isinstance(value, str):
            found.update(secrets_in(value))

    walk(options or {})
    return _with_encodings(found)


def environment_secrets(names: Iterable[str]) -> frozenset[str]:
    """The secrets in the environment variables ``names`` that a backend library reads
    credentials from (``AZURE_STORAGE_CONNECTION_STRING``, ...), as ``option_secrets`` finds
    them: a library may echo them although the user never passed them to Zephon."""
    return option_secrets({name: os.environ[name] for name in names if os.environ.get(name)})


def _with_encodings(values: Iterable[str]) -> frozenset[str]:
    out: set[str] = set()
    for value in values:
        if not value or value == MASK:
            continue
        out.update({value, unquote(value), quote(value, safe="")})
    return frozenset(out)


def redact_options(options: Any) -> Any:
    """A copy of ``storage_options`` for display: values of secret-named keys become
    ``***`` at any depth, and URLs and pairs inside the other strings are masked."""
    if isinstance(options, Mapping):
        return {
            key: (MASK if is_secret_name(key) and value is not None else redact_options(value))
            for key, value in options.items()
        }
    if isinstance(options, list | tuple):
        return type(options)(redact_options(item) for item in options)
    if isinstance(options, str):
        return redact(options)
    return options
