"""Authenticated generations: an HMAC-SHA256 over the manifest, with a key only the trainer has.

The manifest's digest of every file detects corruption, not tampering: whoever can write the
run directory (or its prefix in a bucket) can change a file and fix the manifest up. With a
signing key, every manifest the trainer writes carries
`"signature": {"algorithm": "hmac-sha256", "hmac": HEX}` over its canonical bytes (the
manifest as `encode_json` writes it, without the signature), and those bytes hold every
file's size and digest (BLAKE3, or sha256 in older generations; both cryptographic, so no
file can be changed under its digest), so the signature covers every byte of the
generation. A reader with the key refuses (65) an unsigned manifest, unless `--allow-unsigned` adopts a run that
started before signing, and always refuses one whose signature does not match.

The key is read from a file (`--signing-key-file`, or the file `TRAINER_SIGNING_KEY_FILE`
names, e.g. a mounted Kubernetes Secret): never a command-line value, never logged, never in
a record; `Signing` keeps it out of its repr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from trainer.checkpoint.atomic import encode_json
from trainer.config import SigningConfig
from trainer.errors import NothingToResume, UsageError

ALGORITHM = "hmac-sha256"
SIGNATURE = "signature"
"""The manifest field holding {"algorithm", "hmac"}; everything else is what is signed."""
KEY_FILE_ENV = "TRAINER_SIGNING_KEY_FILE"
"""Names the key file when `--signing-key-file` is not given."""
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 1 << 16


@dataclass(frozen=True)
class Signing:
    """The signing key of a run and what a reader accepts without a signature."""

    key: bytes = field(repr=False)
    allow_unsigned: bool = False
    """Accept manifests without a signature (a run that started before signing); a
    signature that does not match is refused all the same."""

    def sign(self, canonical: bytes) -> dict:
        return {"algorithm": ALGORITHM, "hmac": hmac.new(self.key, canonical, hashlib.sha256).hexdigest()}

    def problem(self, signature: dict | None, canonical: bytes) -> str | None:
        """Why a manifest with this signature (None: unsigned) and canonical bytes is not
        authentic under this key, as "manifest.json: why"; None if it is (or may be adopted)."""
        if signature is None:
            if self.allow_unsigned:
                return None
            return ("manifest.json: not signed, and a signing key is configured; if this run started before "
                    "signing, adopt it with --allow-unsigned (its next generations are signed)")
        expected = self.sign(canonical)["hmac"]
        if not hmac.compare_digest(expected, str(signature.get("hmac", ""))):
            return ("manifest.json: the signature does not match the signing key (a file or the manifest was "
                    "changed after signing, or another key signed it)")
        return None


def canonical_bytes(data: dict) -> bytes:
    """What a signature covers: the manifest as written, without its signature."""
    return encode_json({name: value for name, value in data.items() if name != SIGNATURE})


def encode_signed(data: dict, signing: Signing | None) -> bytes:
    """The manifest's bytes as written: signed when a key is configured."""
    if signing is None:
        return encode_json(data)
    return encode_json({**data, SIGNATURE: signing.sign(canonical_bytes(data))})


def authenticated(verification, signing: Signing | None):
    """A Verification (trainer/checkpoint/manifest.py), failed if its manifest is not
    authentic under `signing`; unchanged without a key or when it failed already."""
    if signing is None or not verification.ok:
        return verification
    manifest = verification.manifest
    problem = signing.problem(manifest.signature, manifest.canonical)
    return verification if problem is None else dataclasses.replace(verification, problem=problem)


def signature_problem(signature) -> str | None:
    """What is wrong with a manifest's `signature` field as written, whatever the key."""
    if not isinstance(signature, dict) or not isinstance(signature.get("algorithm"), str):
        return "signature is not {algorithm, hmac}"
    if signature["algorithm"] != ALGORITHM:
        return (f"signature algorithm {signature['algorithm']!r} is unknown (this trainer signs and checks "
                f"{ALGORITHM})")
    value = signature.get("hmac")
    if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
        return "signature hmac is not 64 hex digits"
    return None


def read_key(path: Path) -> bytes:
    """The key bytes of a key file (surrounding whitespace stripped: a Secret often ends in a
    newline); a missing or unusable file is one line that names the file, never its content."""
    try:
        size = path.stat().st_size
        if size > MAX_KEY_BYTES:
            raise UsageError(f"signing key file {path} is {size} bytes; a key is {MIN_KEY_BYTES} to "
                             f"{MAX_KEY_BYTES} bytes")
        key = path.read_bytes().strip()
    except FileNotFoundError:
        raise NothingToResume(f"signing key file {path} does not exist; mount the Secret there or fix "
                              f"--signing-key-file / ${KEY_FILE_ENV}") from None
    except IsADirectoryError:
        raise UsageError(f"signing key file {path} is a directory; name the file inside it") from None
    except PermissionError:
        raise UsageError(f"signing key file {path} is not readable by this user; fix its permissions") from None
    if len(key) < MIN_KEY_BYTES:
        raise UsageError(f"signing key file {path} holds {len(key)} bytes; use a random key of at least "
                         f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32 > {path.name}`)")
    return key


def load_signing(config: SigningConfig) -> Signing | None:
    """The run's Signing, or None without a key file."""
    if config.key_file is None:
        if config.allow_unsigned:
            raise UsageError(f"--allow-unsigned goes with a signing key (--signing-key-file or ${KEY_FILE_ENV}); "
                             f"without one nothing is checked: drop it")
        return None
    return Signing(read_key(config.key_file), config.allow_unsigned)
