"""``ridethrough certs``: a certificate authority and certificates for mutual TLS in the lab and in tests.

One CA signs one certificate per name (controller, gateway, each agent). Every certificate is
good for both ends of a TLS connection (extended key usage serverAuth and clientAuth), so the
same files serve the agent's control-plane server and its OTLP client, the controller's control
client, and the gateway's OTLP server. Keys are EC P-256, written with mode 0600.

Made with the ``openssl`` command line (present wherever Python's ``ssl`` module is built), so
the package needs no cryptography dependency. An existing CA in the folder is reused, so that
certificates for new nodes chain to the one the others already trust; a file that exists is
never overwritten unless asked (``--force``). Lab use only: a production fleet takes its
certificates from its own PKI (cert-manager, Vault, ...).

Layout of the output folder::

    ca.pem  ca.key            the authority (keep ca.key off the nodes)
    NAME.pem  NAME.key        one pair per --name
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_OPENSSL_TIMEOUT_S = 60


class CertError(Exception):
    """Certificates could not be made; the message says why (openssl's own words included)."""


@dataclass(frozen=True, slots=True)
class Issued:
    """What `make_certs` wrote: the CA certificate and each name's certificate and key."""

    ca_cert: Path
    ca_key: Path
    ca_reused: bool
    leaves: dict[str, tuple[Path, Path]]


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise CertError("the openssl command is not installed (Debian: apt-get install openssl)")
    try:
        subprocess.run([exe, *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=_OPENSSL_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise CertError(f"openssl {args[0]} failed: {exc.stderr.strip()[-400:]}") from None
    except subprocess.TimeoutExpired:
        raise CertError(f"openssl {args[0]} took more than {_OPENSSL_TIMEOUT_S} s") from None


def _san(entry: str) -> str:
    """``IP:`` for an address, ``DNS:`` for a name."""
    try:
        ipaddress.ip_address(entry)
    except ValueError:
        return f"DNS:{entry}"
    return f"IP:{entry}"


def _check(names: Sequence[str], sans: Sequence[str], days: int) -> None:
    if not names:
        raise CertError("give at least one --name")
    for name in names:
        if not _NAME.fullmatch(name) or name == "ca":
            raise CertError(f"name {name!r} must match {_NAME.pattern} and not be 'ca'")
    if len(set(names)) != len(names):
        raise CertError("each --name may be given once")
    for san in sans:
        if not san or any(c in san for c in ", \n\t"):
            raise CertError(f"subject alternative name {san!r} must be one host name or address")
    if not 1 <= days <= 3650:
        raise CertError(f"days must be 1 to 3650, got {days}")


def _make_ca(out: Path, work: Path, days: int, ca_name: str) -> None:
    _openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(days), "-subj",
             f"/CN={ca_name}", "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=work)
    _install(work / "ca.key", out / "ca.key", 0o600)
    _install(work / "ca.pem", out / "ca.pem", 0o644)


def _make_leaf(name: str, sans: Sequence[str], out: Path, work: Path, days: int) -> tuple[Path, Path]:
    alt = ",".join(dict.fromkeys(_san(s) for s in (name, *sans)))
    (work / f"{name}.ext").write_text(
        f"subjectAltName={alt}\nextendedKeyUsage=serverAuth,clientAuth\n"
        "keyUsage=critical,digitalSignature,keyAgreement\nbasicConstraints=critical,CA:FALSE\n")
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=work)
    # a random serial: no serial file to keep, and two certificates never share one
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(out / "ca.pem"), "-CAkey", str(out / "ca.key"),
             "-set_serial", f"0x{secrets.token_hex(16)}", "-out", f"{name}.pem", "-days", str(days),
             "-extfile", f"{name}.ext", cwd=work)
    _openssl("verify", "-CAfile", str(out / "ca.pem"), f"{name}.pem", cwd=work)
    _install(work / f"{name}.key", out / f"{name}.key", 0o600)
    _install(work / f"{name}.pem", out / f"{name}.pem", 0o644)
    return out / f"{name}.pem", out / f"{name}.key"


def _install(src: Path, dst: Path, mode: int) -> None:
    os.chmod(src, mode)
    os.replace(src, dst)  # same file system (the work folder is inside ``out``): atomic


def make_certs(out: Path, *, names: Sequence[str], sans: Sequence[str] = ("localhost", "127.0.0.1"),
               days: int = 30, force: bool = False, ca_name: str = "ridethrough-lab-ca") -> Issued:
    """A CA in ``out`` (reused if there) and a certificate and key for each of ``names``.

    Raises `CertError` for bad arguments, files that exist (without ``force``) or an openssl failure.
    """
    _check(names, sans, days)
    out.mkdir(parents=True, exist_ok=True)
    have_ca = (out / "ca.pem").exists()
    if have_ca != (out / "ca.key").exists():  # a new CA would orphan every certificate the old one signed
        raise CertError(f"{out} holds one of ca.pem and ca.key without the other; restore it or use another folder")
    if not force:
        taken = [f"{n}.{ext}" for n in names for ext in ("pem", "key") if (out / f"{n}.{ext}").exists()]
        if taken:
            raise CertError(f"{out} already holds {', '.join(taken)}; pass --force to replace them")
    with tempfile.TemporaryDirectory(prefix=".certs-", dir=out) as tmp:
        work = Path(tmp)
        if not have_ca:
            _make_ca(out, work, days, ca_name)
        leaves = {name: _make_leaf(name, sans, out, work, days) for name in names}
    return Issued(out / "ca.pem", out / "ca.key", have_ca, leaves)


def certs_command(
    out: Annotated[Path, typer.Argument(help="Folder for ca.pem/ca.key and NAME.pem/NAME.key.")],
    name: Annotated[list[str] | None, typer.Option(
        "--name", help="A certificate to make (repeat): controller, gateway, each agent's node id.")] = None,
    san: Annotated[list[str] | None, typer.Option(
        "--san", help="Host name or address every certificate is valid for (repeat); "
                      "default localhost and 127.0.0.1.")] = None,
    days: Annotated[int, typer.Option(help="Validity in days.")] = 30,
    force: Annotated[bool, typer.Option("--force", help="Replace certificates that exist.")] = False,
) -> None:
    """Make a lab CA and mutual-TLS certificates (controller <-> agents, agents -> gateway)."""
    names = name or ["controller", "gateway", "agent"]
    try:
        issued = make_certs(out, names=names, sans=san or ["localhost", "127.0.0.1"], days=days, force=force)
    except CertError as exc:
        typer.echo(f"ridethrough: certs: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"CA: {issued.ca_cert} ({'reused' if issued.ca_reused else 'new'}; keep {issued.ca_key} private)")
    for leaf, (cert, key) in issued.leaves.items():
        typer.echo(f"{leaf}: {cert} {key}")
    typer.echo("agent control plane: tls_cert_file, tls_key_file = its pair; tls_client_ca_file = ca.pem\n"
               "controller client: tls_ca_file = ca.pem; tls_cert_file, tls_key_file = controller's pair")
