"""web-config.yml: TLS and basic auth for the HTTP endpoint, in the format of the Prometheus
exporter-toolkit (``--web.config.file`` of node_exporter and the other exporters), so that a
site gives nodescope the file its other exporters already use.

What is read (the toolkit's documentation, docs/web-configuration.md, defines each key)::

    tls_server_config:
      cert_file: /etc/nodescope/tls.crt      # PEM certificate (chain), required with TLS
      key_file: /etc/nodescope/tls.key       # PEM private key, required with TLS
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert, VerifyClientCertIfGiven
      client_ca_file: /etc/nodescope/ca.crt  # CAs client certificates must chain to
      client_allowed_sans: [prometheus.example]      # names a client certificate must carry
      min_version: TLS12                     # TLS10, TLS11, TLS12 (default), TLS13
      max_version: TLS13
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # TLS 1.2 and below only
      prefer_server_cipher_suites: true
    http_server_config:
      http2: true                            # accepted; nodescope answers HTTP/1.1
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2y$10$...                 # bcrypt hash: htpasswd -nBC 10 prometheus

What Python's :mod:`ssl` cannot do is refused with an error that names the key, never
ignored: ``client_auth_type`` RequestClientCert and RequireAnyClientCert (OpenSSL through
:mod:`ssl` cannot ask for a certificate without verifying it), ``curve_preferences``,
inline ``cert``/``key`` and TLS 1.3 ``cipher_suites`` (neither Go nor OpenSSL lets them be
chosen there). Unknown keys are errors too, as in the toolkit.

The daemon checks the file at start (a bad one exits with status 2) and hands what it found
to the serving process as a JSON document (:meth:`WebConfig.settings`); the serving process
loads the TLS files itself, before it gives up root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodescope import fileio, serving
from nodescope.errors import ConfigError

#: The user the serving process becomes once it has its socket and its TLS files.
SERVING_USER = "nobody"

_CLIENT_AUTH = {
    "": "none",
    "NoClientCert": "none",
    "VerifyClientCertIfGiven": "optional",
    "RequireAndVerifyClientCert": "required",
}
_CLIENT_AUTH_REFUSED = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")

#: The suites Go's crypto/tls lets exporter-toolkit configure (TLS 1.2 and below), by their
#: IANA names, with the OpenSSL names :meth:`ssl.SSLContext.set_ciphers` takes.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    # Go's older names for the two above.
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
_TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")

#: Response headers the file may set: the toolkit's list. Anything else (Content-Type,
#: Set-Cookie, ...) would change what a response means.
ALLOWED_HEADERS = (
    "Cache-Control",
    "Content-Security-Policy",
    "Strict-Transport-Security",
    "X-Content-Type-Options",
    "X-Frame-Options",
    "X-XSS-Protection",
)
#: bcrypt's modular crypt format: $2a$, $2b$ or $2y$, a two-digit cost, 22 characters of salt
#: and 31 of hash in bcrypt's base64 alphabet.
_BCRYPT = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
MAX_USERS = 1000
MAX_HEADER_VALUE = 1024


@dataclass(frozen=True)
class TLSSettings:
    cert_file: str
    key_file: str
    client_auth: str = "none"
    client_ca_file: str = ""
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = ""
    ciphers: str = ""
    prefer_server_cipher_suites: bool = True

    def settings(self) -> dict[str, object]:
        return {
            "cert_file": self.cert_file,
            "key_file": self.key_file,
            "client_auth": self.client_auth,
            "client_ca_file": self.client_ca_file,
            "client_allowed_sans": list(self.client_allowed_sans),
            "min_version": self.min_version,
            "max_version": self.max_version,
            "ciphers": self.ciphers,
            "prefer_server_cipher_suites": self.prefer_server_cipher_suites,
        }


@dataclass(frozen=True)
class WebConfig:
    """What the serving process needs from web-config.yml, checked."""

    path: str = ""
    tls: TLSSettings | None = None
    #: user name -> bcrypt hash
    users: dict[str, str] = field(default_factory=dict)
    #: header name -> value, added to every response
    headers: dict[str, str] = field(default_factory=dict)
    user: str = SERVING_USER

    def settings(self) -> dict[str, object]:
        """The JSON document the serving process reads (nodescope.serving.build_server)."""
        document: dict[str, object] = {
            "user": self.user,
            "tls": self.tls.settings() if self.tls is not None else None,
            "users": dict(self.users),
            "headers": dict(self.headers),
        }
        if self.users:
            import bcrypt

            # The serving process runs without site-packages (python -I -S): it is given the
            # one directory that holds bcrypt.
            document["bcrypt_path"] = str(Path(bcrypt.__file__).resolve().parent.parent)
        return document


def load(path: str) -> WebConfig:
    """Read and check ``path``; raises :class:`ConfigError` naming the file and the key."""
    try:
        data = fileio.read_bytes(path, fileio.CONFIG)
    except OSError as exc:
        raise ConfigError(path, None, f"cannot read: {exc.strerror or exc}") from None
    return parse(data, path)


def parse(data: bytes, path: str = "<web-config>") -> WebConfig:
    import yaml

    try:
        document = yaml.safe_load(data)
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(path, None, f"not valid YAML: {exc}") from None
    if document is None:
        document = {}
    top = _mapping(document, path, "")
    _no_unknown(top, path, "", ("tls_server_config", "http_server_config", "basic_auth_users"))
    tls = _tls(top.get("tls_server_config"), path)
    headers = _http(top.get("http_server_config"), path)
    users = _users(top.get("basic_auth_users"), path)
    config = WebConfig(path=path, tls=tls, users=users, headers=headers)
    if tls is not None:
        _check_tls_loads(tls, path)
    return config


def _mapping(value: Any, path: str, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(path, key or None, "expected a mapping with string keys")
    return value


def _no_unknown(mapping: dict[str, Any], path: str, prefix: str, known: tuple[str, ...]) -> None:
    for key in mapping:
        if key not in known:
            raise ConfigError(path, f"{prefix}{key}", f"unknown key (known: {', '.join(known)})")


def _string(value: Any, path: str, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(path, key, f"expected a string, got {type(value).__name__}")
    return value


def _strings(value: Any, path: str, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(path, key, "expected a list of strings")
    return [_string(item, path, key) for item in value]


def _tls(value: Any, path: str) -> TLSSettings | None:
    if value is None:
        return None
    prefix = "tls_server_config."
    tls = _mapping(value, path, "tls_server_config")
    refused = {
        "cert": "inline certificates are not supported: use cert_file",
        "key": "inline keys are not supported: use key_file",
        "curve_preferences": "Python's ssl cannot choose key exchange groups; remove the key",
    }
    for key, reason in refused.items():
        if key in tls:
            raise ConfigError(path, prefix + key, reason)
    known = (
        "cert_file", "key_file", "client_auth_type", "client_ca_file", "client_allowed_sans",
        "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
    )  # fmt: skip
    _no_unknown(tls, path, prefix, known)
    if not tls:
        return None
    for key in ("cert_file", "key_file"):
        if not tls.get(key):
            raise ConfigError(path, prefix + key, "required when tls_server_config is set")
    cert_file = _string(tls["cert_file"], path, prefix + "cert_file")
    key_file = _string(tls["key_file"], path, prefix + "key_file")
    auth_type = _string(tls.get("client_auth_type", ""), path, prefix + "client_auth_type")
    if auth_type in _CLIENT_AUTH_REFUSED:
        raise ConfigError(
            path,
            prefix + "client_auth_type",
            f"{auth_type} (a client certificate that is not verified) is not supported: "
            "use RequireAndVerifyClientCert or VerifyClientCertIfGiven with client_ca_file",
        )
    if auth_type not in _CLIENT_AUTH:
        choices = ", ".join(k for k in _CLIENT_AUTH if k)
        raise ConfigError(path, prefix + "client_auth_type", f"{auth_type!r}: one of {choices}")
    client_auth = _CLIENT_AUTH[auth_type]
    ca_file = _string(tls.get("client_ca_file") or "", path, prefix + "client_ca_file")
    if client_auth != "none" and not ca_file:
        raise ConfigError(path, prefix + "client_ca_file", f"required by {auth_type}")
    if client_auth == "none" and ca_file:
        raise ConfigError(
            path, prefix + "client_ca_file", "set without a client_auth_type that verifies"
        )
    sans = _strings(tls.get("client_allowed_sans"), path, prefix + "client_allowed_sans")
    if sans and client_auth != "required":
        raise ConfigError(
            path,
            prefix + "client_allowed_sans",
            "needs client_auth_type RequireAndVerifyClientCert",
        )
    versions = {}
    for key, default in (("min_version", "TLS12"), ("max_version", "")):
        version = _string(tls.get(key) or default, path, prefix + key)
        if version and version not in serving.TLS_VERSIONS:
            choices = ", ".join(serving.TLS_VERSIONS)
            raise ConfigError(path, prefix + key, f"{version!r}: one of {choices}")
        versions[key] = version
    if versions["max_version"] and serving.TLS_VERSIONS.index(
        versions["max_version"]
    ) < serving.TLS_VERSIONS.index(versions["min_version"]):
        raise ConfigError(path, prefix + "max_version", "below min_version")
    ciphers = []
    for name in _strings(tls.get("cipher_suites"), path, prefix + "cipher_suites"):
        if name in _TLS13_SUITES:
            raise ConfigError(
                path, prefix + "cipher_suites", f"{name}: TLS 1.3 suites cannot be chosen"
            )
        if name not in CIPHER_SUITES:
            raise ConfigError(path, prefix + "cipher_suites", f"{name}: unknown or insecure suite")
        ciphers.append(CIPHER_SUITES[name])
    prefer = tls.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(path, prefix + "prefer_server_cipher_suites", "expected true or false")
    return TLSSettings(
        cert_file=cert_file,
        key_file=key_file,
        client_auth=client_auth,
        client_ca_file=ca_file,
        client_allowed_sans=tuple(sans),
        min_version=versions["min_version"],
        max_version=versions["max_version"],
        ciphers=":".join(ciphers),
        prefer_server_cipher_suites=prefer,
    )


def _check_tls_loads(tls: TLSSettings, path: str) -> None:
    """Build the context as the serving process will, so a missing file, a key that does not
    match its certificate or a suite OpenSSL refuses is an error now."""
    import ssl

    try:
        serving.tls_context(tls.settings())
    except ssl.SSLError as exc:
        raise ConfigError(path, "tls_server_config", f"TLS setup failed: {exc}") from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConfigError(
            path, "tls_server_config", f"cannot read{where}: {exc.strerror or exc}"
        ) from None


def _http(value: Any, path: str) -> dict[str, str]:
    prefix = "http_server_config."
    http = _mapping(value, path, "http_server_config")
    _no_unknown(http, path, prefix, ("http2", "headers"))
    if "http2" in http and not isinstance(http["http2"], bool):
        raise ConfigError(path, prefix + "http2", "expected true or false")
    headers: dict[str, str] = {}
    allowed = {name.lower(): name for name in ALLOWED_HEADERS}
    for name, raw in _mapping(http.get("headers"), path, prefix + "headers").items():
        key = f"{prefix}headers.{name}"
        if name.lower() not in allowed:
            raise ConfigError(path, key, f"not one of {', '.join(ALLOWED_HEADERS)}")
        text = _string(raw, path, key)
        if not text or len(text) > MAX_HEADER_VALUE or not text.isascii():
            raise ConfigError(path, key, f"expected 1 to {MAX_HEADER_VALUE} ASCII characters")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            raise ConfigError(path, key, "control characters (a line break) are not allowed")
        headers[allowed[name.lower()]] = text
    return headers


def _users(value: Any, path: str) -> dict[str, str]:
    users = _mapping(value, path, "basic_auth_users")
    if len(users) > MAX_USERS:
        raise ConfigError(path, "basic_auth_users", f"more than {MAX_USERS} users")
    checked: dict[str, str] = {}
    for name, hashed in users.items():
        key = f"basic_auth_users.{name}"
        if not name or ":" in name or len(name) > 256 or not name.isprintable():
            raise ConfigError(path, key, "a user name is 1 to 256 printable characters, no ':'")
        text = _string(hashed, path, key)
        if not _BCRYPT.fullmatch(text):
            raise ConfigError(
                path, key, "not a bcrypt hash ($2y$10$ and 53 characters; htpasswd -nBC 10 USER)"
            )
        checked[name] = text
    return checked
