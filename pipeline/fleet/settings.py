"""Where the fleet's services are, read from the environment, never from a run's config.

A run's config is written into its record, every manifest and the registry's tags, so it holds no
address that could carry a password: the coordination database comes from ``QERL_FLEET_DB`` (a
``postgresql://`` URL; the password may also come from ``PGPASSWORD`` or ``PGPASSFILE``, which libpq
reads itself), S3 credentials from the variables boto3 reads (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``), MLflow's from ``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``. ``QERL_CREDENTIALS_FILE`` names a file of ``NAME=value`` lines that fills
any of these not already set (so a worker's unit file names one file, readable by its user only).

Without ``QERL_FLEET_DB`` qerl runs on one machine as before: locks are ``flock`` files and the data
cursor a file in the work directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FLEET_DB_ENV = "QERL_FLEET_DB"
CREDENTIALS_FILE_ENV = "QERL_CREDENTIALS_FILE"
GPU_ID_ENV = "QERL_GPU_ID"  # the GPU a worker pins (a logical id on a machine without GPUs)
GPU_LOCK_DIR_ENV = "QERL_GPU_LOCK_DIR"  # host-local: never a shared filesystem
DEFAULT_GPU_LOCK_DIR = "/tmp/qerl-gpu-locks"
# what a credentials file may set: nothing else, so it cannot change how qerl or Prefect behave
CREDENTIAL_NAMES = (
    FLEET_DB_ENV,
    "PGPASSWORD",
    "PGPASSFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "PREFECT_API_KEY",
    "PREFECT_API_AUTH_STRING",
)


class FleetConfigError(ValueError):
    """A fleet setting is missing or malformed; the message names the variable or file."""


def database_url() -> str | None:
    """The coordination database (``QERL_FLEET_DB``), or None on a single machine."""
    url = os.environ.get(FLEET_DB_ENV, "").strip()
    if not url:
        return None
    if not re.match(r"^postgres(ql)?(\+\w+)?://", url):
        raise FleetConfigError(f"{FLEET_DB_ENV} must be a postgresql:// URL, not '{redact(url)}'")
    return url


def gpu_id() -> str | None:
    return os.environ.get(GPU_ID_ENV) or None


def gpu_lock_dir() -> Path:
    return Path(os.environ.get(GPU_LOCK_DIR_ENV) or DEFAULT_GPU_LOCK_DIR)


def redact(url: str) -> str:
    """``url`` with the password of its user part replaced by ``***``."""
    return re.sub(r"(://[^:/@]+:)[^@/]*@", r"\1***@", url)


def load_credentials_file(path: str | Path | None = None) -> list[str]:
    """Set the credentials of the file at ``path`` (else ``QERL_CREDENTIALS_FILE``) that the
    environment does not set already; returns the names set. Values are never logged."""
    path = path or os.environ.get(CREDENTIALS_FILE_ENV)
    if not path:
        return []
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise FleetConfigError(f"{CREDENTIALS_FILE_ENV}: cannot read {path} ({err.strerror})") from None
    set_names = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip().removeprefix("export ").strip()
        if not sep or name not in CREDENTIAL_NAMES:
            raise FleetConfigError(
                f"{path}:{number}: expected NAME=value with NAME one of {', '.join(CREDENTIAL_NAMES)}"
            )
        if name not in os.environ:
            os.environ[name] = value.strip().strip("'\"")
            set_names.append(name)
    return set_names
