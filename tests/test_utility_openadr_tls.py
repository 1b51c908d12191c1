"""The VEN over TLS with signed messages, as a utility would run it: openleadr's VTN requiring a client certificate and
checking every message's signature against the VEN's fingerprint, the daemon's VEN configured with `cert`, `key`,
`ca_file` and `vtn_fingerprint` ([utility], docs/utility.md). Certificates made here, on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import ipaddress
import warnings
from pathlib import Path
from typing import Any

import pytest

from dimmer.daemon.loop import CycleResult, Daemon
from dimmer.daemon.utility_ven import UtilityVen
from tests.daemon_fakes import FakePlant, loaded_config
from tests.test_utility_openadr import LIMIT_W, VEN_ID, until

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="DSA is deprecated")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import NameOID
    from openleadr import OpenADRServer, utils
    from openleadr.service.vtn_service import VTNService

pytestmark = pytest.mark.filterwarnings("ignore:It is recommended to use web.AppKey:UserWarning")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(tmp: Path, stem: str, cn: str, ca: tuple[Any, Any] | None, kind: str = "ec") -> tuple[Any, Any]:
    """A certificate and its key (EC P-256, or RSA 2048) under `ca` (None: self-signed, a CA), written as PEM."""
    key: Any = ec.generate_private_key(ec.SECP256R1()) if kind == "ec" else rsa.generate_private_key(65537, 2048)
    now = dt.datetime.now(dt.UTC)
    issuer_cert, issuer_key = ca if ca is not None else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(issuer_cert.subject if issuer_cert is not None else _name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if ca is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    (tmp / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    return cert, key


def test_openadr_over_tls_with_signed_messages(tmp_path: Path) -> None:
    """EC P-256 keys (an RSA key's load, twice a signed message, would stall the daemon's loop: docs/utility.md)."""
    ca = _issue(tmp_path, "ca", "utility-ca", None)
    _issue(tmp_path, "vtn", "localhost", ca)
    _issue(tmp_path, "ven", "campus", ca)
    ven_fp = utils.certificate_fingerprint((tmp_path / "ven.pem").read_text())
    vtn_fp = utils.certificate_fingerprint((tmp_path / "vtn.pem").read_text())
    seen: dict[str, Any] = {}
    last: list[CycleResult] = []

    def ven_lookup(ven_id: str) -> dict[str, str]:
        return {"ven_id": VEN_ID, "ven_name": "campus", "fingerprint": ven_fp, "registration_id": "reg-1"}

    async def go() -> None:
        server = OpenADRServer(
            vtn_id="UTILITY",
            http_port=0,
            http_host="127.0.0.1",
            cert=str(tmp_path / "vtn.pem"),
            key=str(tmp_path / "vtn.key"),
            http_cert=str(tmp_path / "vtn.pem"),
            http_key=str(tmp_path / "vtn.key"),
            http_ca_file=str(tmp_path / "ca.pem"),
            ven_lookup=ven_lookup,
            requested_poll_freq=dt.timedelta(seconds=1),
            show_fingerprint=False,
        )

        async def on_register(info: dict[str, Any]) -> tuple[str, str] | bool:
            seen["fingerprint"] = info.get("fingerprint")  # the client certificate the TLS connection presented
            return (VEN_ID, "reg-1") if info.get("fingerprint") == ven_fp else False

        server.add_handler("on_create_party_registration", on_register)
        await server.run()
        port = int(server.app_runner.addresses[0][1])
        loaded = loaded_config(
            tmp_path,
            daemon={"period_s": 0.2, "metrics_address": ""},
            utility={
                "vtn_url": f"https://localhost:{port}/OpenADR2/Simple/2.0b",
                "ven_name": "campus",
                "ven_id": VEN_ID,
                "poll_interval_s": 1,
                "report": False,
                "cert": "ven.pem",
                "key": "ven.key",
                "ca_file": "ca.pem",
                "vtn_fingerprint": vtn_fp,
            },
        )
        # a VEN that expects another VTN's fingerprint ignores every message this one signs: it never registers
        assert loaded.config.utility is not None
        wrong = loaded.config.utility.model_copy(update={"vtn_fingerprint": "00:11:22:33:44:55:66:77:88:99"})
        impostor = UtilityVen(dataclasses.replace(loaded, config=loaded.config.model_copy(update={"utility": wrong})))
        await impostor.start()
        await asyncio.sleep(2.0)
        assert impostor.client is not None and not impostor.registered
        await impostor.stop()

        plant = FakePlant()
        d = Daemon(loaded, bus_factory=plant.factory, metrics_address=None, on_cycle=last.append)
        assert d.utility is not None
        task = asyncio.create_task(d.run())
        try:
            await until(lambda: d.utility is not None and d.utility.registered, 15.0, "the VEN's registration")
            now = dt.datetime.now(dt.UTC)
            iv = [{"dtstart": now, "duration": dt.timedelta(seconds=60), "signal_payload": 0.6}]
            opts: dict[str, str] = {}
            server.add_event(
                VEN_ID,
                "LOAD_CONTROL",
                "x-loadControlCapacity",
                iv,
                event_id="tls-1",
                callback=lambda ven_id, event_id, opt_type: opts.__setitem__(event_id, opt_type),
            )
            await until(lambda: opts.get("tls-1") == "optIn", 8.0, "the signed optIn at the VTN")
            await until(lambda: bool(last) and last[-1].obs.pcc_limit_w == 0.6 * LIMIT_W, 5.0, "the limit")
        finally:
            d.request_stop()
            await asyncio.wait_for(task, 10.0)
            await server.stop()
            # openleadr keeps a VTN's signing key and lookups on its service class: leave none to a later VTN
            for attr in ("ven_lookup",):
                if attr in VTNService.__dict__:
                    delattr(VTNService, attr)
            VTNService.verify_message_signatures = True
        assert seen["fingerprint"] == ven_fp

    asyncio.run(go())
