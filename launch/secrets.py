"""Secret references resolved in the pod: `dflash launch xpk|gcluster --secret NAME=projects/P/secrets/S/versions/V`
passes `DFLASH_SECRET_<NAME>=<that reference>` (never the value) to every pod, and `dflash`, before anything else,
reads each such secret from Secret Manager into the variable `NAME` (`HF_TOKEN`, `WANDB_API_KEY`), unless `NAME` is
set already.

How: the pod's Google identity (GKE Workload Identity: the pod's Kubernetes service account bound to a Google service
account with `roles/secretmanager.secretAccessor` on the secret) gives an access token through the metadata server,
and Secret Manager's REST `versions/V:access` returns the payload. Only the standard library is used (the image has
no Google client library)."""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, MutableMapping

from dflash.configs.schema import ConfigError

SECRET_PREFIX = "DFLASH_SECRET_"  # launch.pod.SECRET_PREFIX
TOKEN_URL = "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token"
ACCESS_URL = "https://secretmanager.googleapis.com/v1/{ref}:access"
TRIES = 3


def _get_json(url: str, headers: dict[str, str]) -> dict:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - fixed https / metadata URLs
        return json.loads(response.read())


def access_secret(ref: str, get_json: Callable[[str, dict[str, str]], dict] | None = None) -> str:
    """The payload of Secret Manager version `ref` (projects/P/secrets/S/versions/V) as text, read with the pod's
    identity; ConfigError naming the reference and what the pod needs when it cannot be read (after TRIES tries)."""
    get_json = get_json or _get_json
    last: Exception | None = None
    for attempt in range(TRIES):
        try:
            token = get_json(TOKEN_URL, {"Metadata-Flavor": "Google"})["access_token"]
            body = get_json(ACCESS_URL.format(ref=ref), {"Authorization": f"Bearer {token}"})
            return base64.b64decode(body["payload"]["data"]).decode()
        except urllib.error.HTTPError as err:
            if err.code in (400, 401, 403, 404):  # no retry can help
                last = err
                break
            last = err
        except (OSError, KeyError, ValueError) as err:
            last = err
        if attempt + 1 < TRIES:
            time.sleep(2**attempt)
    raise ConfigError(f"--secret {ref} could not be read in this pod ({type(last).__name__}: {last}); the pod's "
                      "Kubernetes service account must act as a Google service account (Workload Identity) with "
                      "roles/secretmanager.secretAccessor on that secret")


def resolve_secrets(environ: MutableMapping[str, str] | None = None,
                    access: Callable[[str], str] | None = None) -> list[str]:
    """Set NAME from each DFLASH_SECRET_<NAME> reference of `environ` (default: this process's environment) where NAME
    is not set already; the names set, in order."""
    environ = os.environ if environ is None else environ
    access = access or access_secret
    done = []
    for key in sorted(k for k in environ if k.startswith(SECRET_PREFIX)):
        name = key.removeprefix(SECRET_PREFIX)
        if name and not environ.get(name):
            environ[name] = access(environ[key])
            done.append(name)
    return done


__all__ = ["SECRET_PREFIX", "access_secret", "resolve_secrets"]
