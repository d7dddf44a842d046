"""The credentials of a local run, generated fresh by each launch into one private folder.

    <run_dir>/credentials/          0700, every file 0600
        ca.pem  ca.key              the run's certificate authority (ECDSA P-256)
        server.pem  server.key      nats-server's and every gRPC server's certificate
                                    (localhost, 127.0.0.1, ::1, this host's name); also the
                                    client certificate under mutual TLS
        control.token               bearer token of control RPCs
        nats/<role>.nk              nkey seed of the role's NATS user (see nats_auth.py)
        nats-server.conf            users + permissions + TLS for nats-server

A child gets its role's files by path in its environment (``child_env``), never on its
command line. ``python -m treadle.services.credentials DIR --run NAME`` writes the same
folder for deployments that start services by hand or with compose, and
``... DIR --run NAME --create-streams URL`` creates the streams as the admin user.

Not here: what each role may do (``nats_auth.py``), connecting with them (``bus.py``,
``rpc.py``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import shutil
import socket
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from treadle.services.errors import TreadleError
from treadle.services.nats_auth import ROLES, NatsUser, ServerAuth, permissions

DIR_MODE = 0o700
FILE_MODE = 0o600
# nats-server config: JetStream on, every write synced to disk before it is acknowledged
JETSTREAM_CONF = 'jetstream: {"sync_interval": "always"}\n'


def write_secret(path: Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` readable by this user only (created 0600, never wider)."""
    raw = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.write(fd, raw)
    finally:
        os.close(fd)
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, path)
    return path


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it 0700."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path


def new_token() -> str:
    """A bearer token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def new_nkey_seed() -> tuple[str, str]:
    """(seed, public key) of a fresh NATS user nkey."""
    import nkeys  # type: ignore[import-untyped]

    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    public = kp.public_key.decode()
    kp.wipe()
    return seed.decode(), public


# --- TLS ----------------------------------------------------------------------------------
def _hosts(extra: Iterable[str]) -> list[str]:
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname(), *extra]
    return list(dict.fromkeys(n for n in names if n and n not in ("0.0.0.0", "::")))


def make_ca(common_name: str, days: int = 365) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new self-signed CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key)


def make_leaf(
    ca_cert_pem: bytes, ca_key_pem: bytes, hosts: Sequence[str], days: int = 365
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) signed by the CA, valid for ``hosts`` as server and client."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for h in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _pem(cert, key)


def cert_names(cert_pem: bytes) -> list[str]:
    """The names a certificate is valid for (its subject alternative names: DNS names,
    then IP addresses), in its order; [] when it has none."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    ips = [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)]
    return [*alt.get_values_for_type(x509.DNSName), *ips]


def _pem(cert: Any, key: Any) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization as ser

    cert_pem: bytes = cert.public_bytes(ser.Encoding.PEM)
    key_pem: bytes = key.private_bytes(
        ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()
    )
    return cert_pem, key_pem


# --- a run's folder -----------------------------------------------------------------------
@dataclass(frozen=True)
class RunCredentials:
    """Paths of a run's credential files (see the module doc)."""

    root: Path
    run: str
    ca: Path
    cert: Path
    key: Path
    token: Path
    nats_conf: Path
    seeds: dict[str, Path] = field(default_factory=dict)
    inference_key: Path | None = None  # hosted: the run's key on the shared inference

    def seed(self, role: str) -> Path:
        if role not in self.seeds:
            raise KeyError(f"no NATS credential for role {role!r} in {self.root}")
        return self.seeds[role]

    def child_env(self, role: str) -> dict[str, str]:
        """Environment entries that hand a service of ``role`` its credentials by path."""
        return {
            "TREADLE_NATS__CREDENTIALS": str(self.seed(role)),
            "TREADLE_NATS__TLS_CA": str(self.ca),
            "TREADLE_NATS__MANAGE_STREAMS": "false",
            "TREADLE_CONTROL__TLS_CA": str(self.ca),
            "TREADLE_CONTROL__TLS_CERT": str(self.cert),
            "TREADLE_CONTROL__TLS_KEY": str(self.key),
            "TREADLE_CONTROL__TOKEN_FILE": str(self.token),
        }


def generate(
    root: Path,
    run: str,
    *,
    roles: Sequence[str] = ROLES,
    hosts: Iterable[str] = (),
    verify_clients: bool = False,
) -> RunCredentials:
    """Write a fresh CA, certificate, token and one NATS user per role under ``root``
    (an existing ``root`` is emptied, not removed: it may be a container's volume)."""
    if root.is_dir():
        for child in root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    private_dir(root)
    private_dir(root / "nats")
    ca_pem, ca_key = make_ca(f"treadle run {run} CA")
    cert_pem, key_pem = make_leaf(ca_pem, ca_key, _hosts(hosts))
    creds = RunCredentials(
        root=root,
        run=run,
        ca=write_secret(root / "ca.pem", ca_pem),
        cert=write_secret(root / "server.pem", cert_pem),
        key=write_secret(root / "server.key", key_pem),
        token=write_secret(root / "control.token", new_token()),
        nats_conf=root / "nats-server.conf",
    )
    write_secret(root / "ca.key", ca_key)
    auth = ServerAuth(
        tls_cert=str(creds.cert), tls_key=str(creds.key), tls_ca=str(creds.ca),
        verify_clients=verify_clients,
    )  # fmt: skip
    for role in roles:
        seed, public = new_nkey_seed()
        creds.seeds[role] = write_secret(root / "nats" / f"{role}.nk", seed + "\n")
        auth.users.append(NatsUser(public, permissions(run, role), role, run))
    write_secret(creds.nats_conf, auth.to_conf())
    return creds


def generate_shared(
    root: Path,
    runs: Sequence[str],
    *,
    roles: Sequence[str] = ROLES,
    hosts: Iterable[str] = (),
    verify_clients: bool = False,
) -> dict[str, RunCredentials]:
    """One deployment's credentials for several runs on one nats-server (hosted
    training): one CA, certificate and control token, and for each run one NATS user
    per role, scoped to that run's subjects and streams like ``generate``'s (a run's
    users reach nothing of another run's), and a key for the shared inference deployment
    (``inference.hosted``: a request there reaches only its key's run's adapter). Seeds are
    under ``root/runs/<run>/nats``, keys in ``root/runs/<run>/inference.key``; the one
    ``nats-server.conf`` holds every run's users. Returns each run's view of it.
    ``add_shared_runs`` adds runs later (``treadle platform serve``)."""
    if len(set(runs)) != len(runs) or not runs:
        raise ValueError(f"runs must be distinct and at least one: {list(runs)}")
    generate(root, runs[0], roles=(), hosts=hosts, verify_clients=verify_clients)
    write_secret(root / SHARED_MARK, "verify_clients\n" if verify_clients else "\n")
    return add_shared_runs(root, runs, roles=roles)


SHARED_MARK = "shared"  # generate_shared's folder; "verify_clients" inside: mutual TLS


def add_shared_runs(
    root: Path, runs: Sequence[str], *, roles: Sequence[str] = ROLES
) -> dict[str, RunCredentials]:
    """Add runs to a deployment's credentials (``generate_shared``'s folder): each run's
    users and inference key, then ``nats-server.conf`` rewritten with every run's users.
    A running nats-server takes them on reload (``EmbeddedNats.reload``); nothing of the
    runs already there changes. A run that is there already is a ValueError."""
    if not (root / SHARED_MARK).is_file():
        raise ValueError(f"{root} is not a deployment's credentials folder (generate_shared)")
    taken = sorted(r for r in runs if (root / "runs" / r).exists())
    if taken or len(set(runs)) != len(runs):
        raise ValueError(f"runs must be new and distinct: {taken or list(runs)}")
    shared = load(root, runs[0])
    out: dict[str, RunCredentials] = {}
    for run in runs:
        run_dir = private_dir(private_dir(root / "runs") / run)
        key = write_secret(run_dir / "inference.key", secrets.token_hex(32) + "\n")
        creds = replace(shared, run=run, seeds={}, inference_key=key)
        folder = private_dir(run_dir / "nats")
        for role in roles:
            seed, _ = new_nkey_seed()
            creds.seeds[role] = write_secret(folder / f"{role}.nk", seed + "\n")
        out[run] = creds
    write_shared_conf(root)
    return out


def remove_shared_run(root: Path, run: str) -> None:
    """Forget a run of a deployment's credentials: its users leave ``nats-server.conf``
    (a running nats-server drops them on reload) and its seeds and key are deleted."""
    folder = root / "runs" / run
    if folder.is_dir():
        shutil.rmtree(folder)
    write_shared_conf(root)


def load_shared(root: Path, run: str) -> RunCredentials:
    """One run's view of a deployment's credentials (``generate_shared``'s folder)."""
    run_dir = root / "runs" / run
    if not (run_dir / "nats").is_dir():
        raise KeyError(f"no run {run!r} in the deployment's credentials {root}")
    creds = replace(load(root, run), seeds={}, inference_key=run_dir / "inference.key")
    for role in ROLES:
        if (run_dir / "nats" / f"{role}.nk").exists():
            creds.seeds[role] = run_dir / "nats" / f"{role}.nk"
    return creds


def write_shared_conf(root: Path) -> Path:
    """``nats-server.conf`` of a deployment: TLS and every run's users, each user's public
    key derived from its seed under ``root/runs/<run>/nats``."""
    import nkeys

    shared = load(root, "")
    mark = root / SHARED_MARK
    auth = ServerAuth(
        tls_cert=str(shared.cert), tls_key=str(shared.key), tls_ca=str(shared.ca),
        verify_clients=mark.is_file() and mark.read_text().strip() == "verify_clients",
    )  # fmt: skip
    runs = root / "runs"
    for run_dir in sorted(runs.iterdir()) if runs.is_dir() else []:
        for role in ROLES:
            seed = run_dir / "nats" / f"{role}.nk"
            if seed.is_file():
                kp = nkeys.from_seed(bytearray(seed.read_bytes().strip()))
                public = kp.public_key.decode()
                kp.wipe()
                auth.users.append(NatsUser(public, permissions(run_dir.name, role), role,
                                           run_dir.name))  # fmt: skip
    return write_secret(shared.nats_conf, auth.to_conf())


def load(root: Path, run: str) -> RunCredentials:
    """The credentials ``generate`` wrote under ``root``."""
    creds = RunCredentials(
        root=root, run=run, ca=root / "ca.pem", cert=root / "server.pem",
        key=root / "server.key", token=root / "control.token",
        nats_conf=root / "nats-server.conf",
    )  # fmt: skip
    for role in ROLES:
        if (root / "nats" / f"{role}.nk").exists():
            creds.seeds[role] = root / "nats" / f"{role}.nk"
    return creds


async def create_streams(creds: RunCredentials, url: str, envs: Sequence[str] = ()) -> list[str]:
    """Create the run's streams on ``url`` as its admin user (services may not), and the
    env runners' work-queue consumers of ``envs`` (env runners may not create consumers)."""
    from treadle.services.bus import Bus
    from treadle.services.nats_auth import make_work_queue_consumers
    from treadle.services.sections import NatsSection

    cfg = NatsSection(url=url, credentials=creds.seed("admin"), tls_ca=creds.ca)
    bus = await Bus.connect(cfg, creds.run, name="treadle-credentials", role="admin")
    try:
        names = await bus.ensure_streams()
        return names + await make_work_queue_consumers(bus, envs)
    finally:
        await bus.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m treadle.services.credentials",
        description="Write a run's CA, certificate, control token, NATS users and nats-server "
        "config; or, with --create-streams, create the run's streams as its admin user.",
    )
    parser.add_argument("dir", type=Path, help="the credentials folder (made 0700)")
    parser.add_argument("--run", required=True, help="run name (scopes the NATS permissions)")
    parser.add_argument("--host", action="append", default=[], help="extra certificate host name")
    parser.add_argument(
        "--mtls", action="store_true", help="nats-server requires client certificates"
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave an existing folder as it is (compose restarts)"
    )
    parser.add_argument(
        "--create-streams", metavar="URL", help="connect to URL as admin and create the streams"
    )
    parser.add_argument(
        "--jetstream", action="store_true", help="nats-server.conf also turns JetStream on, "
        "syncing every write to disk (sync_interval: always); nats-server's --store_dir says where",
    )  # fmt: skip
    parser.add_argument(
        "--envs", default="", help="with --create-streams: comma-separated environments whose "
        "work-queue consumers to create for the env runners",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.create_streams:
            import asyncio

            envs = [e for e in args.envs.split(",") if e]
            names = asyncio.run(create_streams(load(args.dir, args.run), args.create_streams, envs))
            print(f"streams and consumers ready: {', '.join(names)}")
            return 0
        if args.keep and (args.dir / "nats-server.conf").exists():
            print(f"kept {args.dir}")
            return 0
        creds = generate(args.dir, args.run, hosts=args.host, verify_clients=args.mtls)
        if args.jetstream:
            conf = creds.nats_conf.read_text() + JETSTREAM_CONF
            write_secret(creds.nats_conf, conf)
    except (OSError, ValueError, KeyError) as e:
        print(f"treadle credentials: {e}", file=sys.stderr)
        return 2
    except TreadleError as e:  # e.g. the bus is unreachable: one line, no traceback
        print(f"treadle credentials: {e}", file=sys.stderr)
        return 1
    print(f"wrote {creds.root} (nats-server config: {creds.nats_conf})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
