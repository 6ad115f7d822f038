"""Rules shared by the apt action plugins (apt_packages, signed_apt_repository): which packages a dpkg probe
shows as installed, the fingerprints of an OpenPGP key, and the deb822 text of a signed source. Pure Python,
run on the control machine, unit-tested in tests/modules/test_apt_rules.py.
"""
from __future__ import annotations

import base64
import hashlib
import re

# A plain Debian package name. Anything else (wildcards, :arch, a .deb path) is left to apt, which alone
# knows how to match it; so is NAME=VERSION unless VERSION is exact (see PINNED).
PLAIN_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")

# NAME=VERSION with an exact version ([epoch:]upstream[-revision], as dpkg prints it). A version with a
# wildcard, or a comparison such as NAME>=VERSION, is left to apt.
PINNED = re.compile(r"^([a-z0-9][a-z0-9+.-]+)=([A-Za-z0-9.+~:-]+)$")

# One tab-separated line per installed or known name: "NAME WANTED-STATUS-ERROR VERSION" (dpkg's
# ${db:Status-Abbrev}, three characters, the last a space when there is no error). Unknown names print
# nothing on stdout and make dpkg-query exit 1.
DPKG_QUERY = ["dpkg-query", "--show", "--showformat=${Package}\\t${db:Status-Abbrev}\\t${Version}\\n"]


def installed_versions(dpkg_query_stdout):
    """{name: set of versions} of the packages the probe's lines show as installed, without an error flag.

    A name has one line per installed architecture (multiarch); dpkg keeps their versions equal."""
    installed = {}
    for line in str(dpkg_query_stdout or "").splitlines():
        name, _, rest = line.partition("\t")
        abbrev, _, version = rest.partition("\t")
        # ${db:Status-Abbrev}: wanted (u i r p h), status (n i c U F h W t), error flag (space: none).
        if len(abbrev) >= 2 and abbrev[1] == "i" and abbrev[2:3] in ("", " "):
            installed.setdefault(name, set()).add(version.strip())
    return installed


def is_plain(name):
    return bool(PLAIN_NAME.match(str(name)))


def pinned(name):
    """(package, version) of an exact NAME=VERSION pin, or None."""
    match = PINNED.match(str(name))
    return (match[1], match[2]) if match else None


def probe_names(names):
    """The package names to ask dpkg about (in order, once each): the plain names and those of exact pins."""
    found = []
    for name in names:
        pin = pinned(name)
        package = pin[0] if pin else str(name) if is_plain(name) else None
        if package and package not in found:
            found.append(package)
    return found


def packages_not_installed(names, dpkg_query_stdout):
    """The names (in order) that apt must still look at: plain names not installed per the probe, pins whose
    package is not installed at exactly that version, and every name only apt can match."""
    installed = installed_versions(dpkg_query_stdout)

    def done(name):
        pin = pinned(name)
        if pin:
            # Every installed architecture at the pinned version; another version is apt's to change.
            return installed.get(pin[0]) == {pin[1]}
        return is_plain(name) and str(name) in installed

    return [name for name in names if not done(name)]


# ---------------------------------------------------------------------------------------------------------
# OpenPGP keys (RFC 4880 / RFC 9580), only as far as a fingerprint check needs: read the public key and
# subkey packets of a key file, armored or binary, and hash them as the standard says.

class KeyDataError(ValueError):
    """The data is not an OpenPGP public key; the message says why."""


_ARMOR_BEGIN = "-----BEGIN PGP PUBLIC KEY BLOCK-----"
_ARMOR_END = "-----END PGP PUBLIC KEY BLOCK-----"
_PUBLIC_KEY, _PUBLIC_SUBKEY = 6, 14


def is_armored(data: bytes) -> bool:
    return _ARMOR_BEGIN.encode() in data


def dearmor(data: bytes) -> bytes:
    """The binary packets of an ASCII-armored public key block (the first block of the data)."""
    text = data.decode("ascii", errors="replace")
    start = text.find(_ARMOR_BEGIN)
    end = text.find(_ARMOR_END, start)
    if start < 0 or end < 0:
        raise KeyDataError("no complete '-----BEGIN PGP PUBLIC KEY BLOCK-----' block")
    lines = text[start + len(_ARMOR_BEGIN):end].strip().splitlines()
    # Armor headers ("Version: ...") end at the first blank line, when there are any.
    if any(not line.strip() for line in lines):
        lines = lines[next(i for i, line in enumerate(lines) if not line.strip()) + 1:]
    body = [line.strip() for line in lines if line.strip() and not line.strip().startswith("=")]
    try:
        return base64.b64decode("".join(body), validate=True)
    except ValueError as error:
        raise KeyDataError(f"the armored block is not valid base64 ({error})") from None


def _crc24(data: bytes) -> int:
    crc = 0xB704CE
    for byte in data:
        crc ^= byte << 16
        for _ in range(8):
            crc <<= 1
            if crc & 0x1000000:
                crc ^= 0x1864CFB
    return crc & 0xFFFFFF


def armor(packets: bytes) -> str:
    """ASCII armor of binary key packets, as `gpg --armor --export` writes it (apt reads it from a .asc file)."""
    encoded = base64.b64encode(packets).decode()
    lines = [encoded[i:i + 64] for i in range(0, len(encoded), 64)]
    checksum = base64.b64encode(_crc24(packets).to_bytes(3, "big")).decode()
    return "\n".join([_ARMOR_BEGIN, "", *lines, "=" + checksum, _ARMOR_END]) + "\n"


def _packets(data: bytes):
    """(tag, body) of each packet of binary OpenPGP data."""
    pos = 0
    while pos < len(data):
        header = data[pos]
        if not header & 0x80:
            raise KeyDataError(f"byte {pos} does not start an OpenPGP packet")
        if header & 0x40:  # new format
            tag = header & 0x3F
            pos += 1
            if pos >= len(data):
                raise KeyDataError("the data ends inside a packet header")
            first = data[pos]
            if first < 192:
                length, pos = first, pos + 1
            elif first < 224:
                length, pos = ((first - 192) << 8) + data[pos + 1] + 192, pos + 2
            elif first == 255:
                length, pos = int.from_bytes(data[pos + 1:pos + 5], "big"), pos + 5
            else:
                raise KeyDataError("partial-length packets do not occur in a key")
        else:  # old format
            tag = (header >> 2) & 0x0F
            kind = header & 0x03
            if kind == 3:
                raise KeyDataError("indeterminate-length packets do not occur in a key")
            size = (1, 2, 4)[kind]
            length = int.from_bytes(data[pos + 1:pos + 1 + size], "big")
            pos += 1 + size
        if pos + length > len(data):
            raise KeyDataError("the data ends inside a packet")
        yield tag, data[pos:pos + length]
        pos += length


def _fingerprint(body: bytes) -> str:
    version = body[0] if body else 0
    if version == 4:
        return hashlib.sha1(b"\x99" + len(body).to_bytes(2, "big") + body).hexdigest().upper()
    if version == 6:
        return hashlib.sha256(b"\x9b" + len(body).to_bytes(4, "big") + body).hexdigest().upper()
    if version == 5:
        return hashlib.sha256(b"\x9a" + len(body).to_bytes(4, "big") + body).hexdigest().upper()
    raise KeyDataError(f"key packet version {version} is not supported (only 4, 5 and 6)")


def key_fingerprints(data: bytes) -> list:
    """Fingerprints (upper-case hex) of the primary keys and subkeys in a key file, armored or binary."""
    packets = dearmor(data) if is_armored(data) else data
    found = [_fingerprint(body) for tag, body in _packets(packets) if tag in (_PUBLIC_KEY, _PUBLIC_SUBKEY)]
    if not found:
        raise KeyDataError("no public key packet in it")
    return found


def normalize_fingerprint(text) -> str:
    """A fingerprint as written by people ("EB69 3B30 ...", "0x...") in gpg's form: 40 (or 64) upper-case hex."""
    value = re.sub(r"\s", "", str(text or "")).upper()
    return value[2:] if value.startswith("0X") else value


def fingerprint_problem(text):
    """Why a given fingerprint cannot be checked against, or None."""
    value = normalize_fingerprint(text)
    if not re.fullmatch(r"[0-9A-F]{40}|[0-9A-F]{64}", value):
        return (f"key_fingerprint {text!r} is not a full fingerprint: give all 40 hexadecimal digits that "
                "`gpg --show-keys KEYFILE` prints (a short key id can be forged)")
    return None


# ---------------------------------------------------------------------------------------------------------
# deb822 sources (sources.list(5)).

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def source_problems(name, uris, suites, components, architectures, key_path):
    """What is wrong with the arguments of a signed source, as messages that say how to fix it."""
    problems = []
    if not NAME.match(str(name or "")):
        problems.append(f"name {name!r} must be a file stem of letters, digits, '.', '_' and '-' "
                        "(apt ignores other names in sources.list.d)")
    if not uris:
        problems.append("uris must list at least one repository URL")
    problems += [f"uris: {uri!r} is not an http(s), file or cdrom URL" for uri in uris or []
                 if not re.match(r"^(https?|file|cdrom|mirror\+https?|tor\+https?)://|^file:/", str(uri))]
    if not suites:
        problems.append("suites must list at least one suite (\"/\" or \"./\" for a flat repository)")
    flat = [suite for suite in suites or [] if str(suite).endswith("/")]
    if flat and components:
        problems.append(f"suites {flat} name a flat repository (ending in '/'), which takes no components; "
                        "set components: []")
    if suites and not flat and not components:
        problems.append("components must list at least one component (e.g. main) unless the suite ends in '/'")
    for field, values in (("suites", suites), ("components", components), ("architectures", architectures)):
        problems += [f"{field}: {value!r} holds a space" for value in values or [] if re.search(r"\s", str(value))]
    if not str(key_path or "").startswith("/") or not str(key_path).endswith(".asc"):
        problems.append(f"key_path {key_path!r} must be an absolute path ending in .asc (the key is kept "
                        "ASCII-armored, which apt reads from a .asc file only)")
    return problems


def render_source(uris, suites, components, architectures, signed_by, managed_by=""):
    """The text of a deb822 .sources file that trusts signed_by alone."""
    lines = [f"# {managed_by}"] if managed_by else []
    lines += ["Types: deb", "URIs: " + " ".join(uris), "Suites: " + " ".join(suites)]
    if components:
        lines.append("Components: " + " ".join(components))
    if architectures:
        lines.append("Architectures: " + " ".join(architectures))
    lines.append(f"Signed-By: {signed_by}")
    return "\n".join(lines) + "\n"
