"""`[utility]` of the site config: the daemon as a VEN of the utility's OpenADR VTN (docs/utility.md).

    [utility]
    protocol = "openadr2b"                          # the only one so far (openleadr)
    vtn_url = "https://vtn.example.com/OpenADR2/Simple/2.0b"
    ven_name = "campus-a"
    ven_id = "..."                                  # optional: the VTN assigns one at registration

Checked like every key at load (file, key, expected; exit status 2): the schema here, paths and the daemon's role in
`check_utility`.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from dimmer.errors import InputError
from dimmer.inputfile import check_input_file, read_input_bytes
from dimmer.siteconfig import Name, Strict

if TYPE_CHECKING:
    from dimmer.daemon.config import DaemonConfig

MAX_PEM_BYTES = 1024 * 1024  # a certificate chain is a few kB
# what a payload without a unit of its own is in (a signal with an itemBase of power carries its own SI scale)
PAYLOAD_SCALE_W = {"W": 1.0, "kW": 1e3, "MW": 1e6}


class UtilitySpec(Strict):
    """The utility's VTN, how the daemon registers with it, what it accepts and what it reports."""

    enabled: bool = True
    protocol: Literal["openadr2b"] = "openadr2b"
    vtn_url: str
    ven_name: Name
    ven_id: Name | None = None
    # how often to poll the VTN; none: as often as the VTN asks at registration
    poll_interval_s: float | None = Field(default=None, ge=1, le=3600)
    # "in": opt in to every event with a signal the daemon plans on (docs/utility.md), out of the rest;
    # "out": opt out of every event (the daemon registers and reports, but plans on nothing the utility sends)
    opt: Literal["in", "out"] = "in"
    # opt out of an event that asks for an import limit or load target below this share of the interconnect limit
    min_limit_frac: float = Field(default=0.0, ge=0, le=1)
    payload_unit: Literal["W", "kW", "MW"] = "kW"
    # SIMPLE signal levels 0..3 -> the import limit as a share of the interconnect limit (an agreement with the utility)
    simple_levels: list[float] = Field(default=[1.0, 0.9, 0.75, 0.5], min_length=1, max_length=4)
    # telemetry reports offered to the VTN: the import at the interconnect and the flexibility available
    report: bool = True
    report_interval_s: float = Field(default=10.0, ge=1, le=3600)
    # TLS client certificate and key, and the CA the VTN's certificate is checked against (all three or none:
    # openleadr's TLS takes them together): the VEN's identity, its messages signed with them; vtn_fingerprint: the
    # VTN's signatures checked
    cert: str | None = None
    key: str | None = None
    ca_file: str | None = None
    vtn_fingerprint: str | None = Field(default=None, pattern=r"^[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){9}$")

    @field_validator("vtn_url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an http:// or https:// URL of the VTN, e.g. https://vtn.example.com/OpenADR2/Simple/2.0b")
        return v

    @field_validator("simple_levels")
    @classmethod
    def _levels(cls, v: list[float]) -> list[float]:
        if any(not 0 < x <= 1 for x in v):
            raise ValueError("shares of the interconnect limit in (0, 1]")
        if any(b > a for a, b in itertools.pairwise(v)):
            raise ValueError("shares that never rise from one level to the next")
        return v

    @model_validator(mode="after")
    def _cert_key(self) -> UtilitySpec:
        if len({self.cert is None, self.key is None, self.ca_file is None}) > 1:
            raise ValueError("give cert, key and ca_file together (openleadr's TLS takes all three), or none of them")
        return self

    @property
    def payload_scale_w(self) -> float:
        return PAYLOAD_SCALE_W[self.payload_unit]


def check_utility(cfg: DaemonConfig, source: str, base_dir: Path, role: str) -> None:
    """InputError for a `[utility]` this daemon cannot run: on a building daemon (its coordinator faces the utility),
    or with a certificate, key or CA file that cannot be read."""
    spec = cfg.utility
    if spec is None:
        return
    if role == "building":
        why = "no [utility] on a building daemon: its coordinator (or a flat daemon) speaks to the utility"
        raise InputError(source, "utility", why)
    if spec.enabled and importlib.util.find_spec("openleadr") is None:
        why = "openadr2b with openleadr installed (pip install 'dimmer[utility]')"
        raise InputError(source, "utility.protocol", why)
    for key in ("cert", "key", "ca_file"):
        path = getattr(spec, key)
        if path is not None:
            p = Path(path).expanduser()
            p = p if p.is_absolute() else base_dir / p
            check_input_file(p, source, f"utility.{key}", "PEM file", MAX_PEM_BYTES)
            if spec.enabled:
                _check_pem(read_input_bytes(p, source, f"utility.{key}", "PEM file", MAX_PEM_BYTES), source, key)


def _check_pem(data: bytes, source: str, key: str) -> None:
    """InputError unless `data` is what `key` names: certificates (cert, ca_file) or an unencrypted private key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        if key == "key":
            serialization.load_pem_private_key(data, None)
        else:
            x509.load_pem_x509_certificates(data)
    except (ValueError, TypeError):
        what = "an unencrypted PEM private key" if key == "key" else "PEM certificates"
        raise InputError(source, f"utility.{key}", what) from None


def key_is_rsa(path: Path) -> bool:
    """Whether the private key at `path` (checked at load) is RSA: openleadr loads the key twice for every message it
    signs, and cryptography's RSA load holds the GIL ~0.1 s on a 2-core machine (an EC key: ~30 µs)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    return isinstance(serialization.load_pem_private_key(path.read_bytes(), None), rsa.RSAPrivateKey)
