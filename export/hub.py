"""Upload an exported directory to the Hugging Face Hub in one commit, through `huggingface_hub`.

The token is `HF_TOKEN` or the stored login (`hf auth login`), as huggingface_hub finds it; the endpoint is
huggingface_hub's (`HF_ENDPOINT`) unless one is passed. A repo that does not exist is created (private when
asked); an existing public repo is refused when `private` is asked (its files would be public). Every HTTP
failure becomes a `HubError` that says what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class HubError(RuntimeError):
    """The upload cannot be done: no token, a rejected token, no write access, or a Hub error."""


@dataclass(frozen=True)
class Upload:
    repo_id: str
    revision: str
    private: bool
    commit_message: str
    endpoint: str


def plan_upload(repo_id: str, *, private: bool, revision: str | None, commit_message: str,
                endpoint: str | None = None) -> Upload:
    """What an upload would do (validated repo id, resolved endpoint), without sending anything."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise HubError(f"--push-to-hub must be a Hub repo id like 'user/name'; received {repo_id!r} ({err})") from err
    if "/" not in repo_id:
        raise HubError(f"--push-to-hub must name the owner: 'user/name' or 'org/name'; received {repo_id!r}")
    return Upload(repo_id=repo_id, revision=revision or "main", private=private, commit_message=commit_message,
                  endpoint=(endpoint or constants.ENDPOINT).rstrip("/"))


def _explain(err: Exception, upload: Upload, what: str) -> HubError:
    from huggingface_hub.errors import HfHubHTTPError

    status = getattr(getattr(err, "response", None), "status_code", None)
    where = f"{upload.endpoint} ({upload.repo_id})"
    if status == 401:
        return HubError(f"the Hub at {where} rejected the token while trying to {what} (401 Unauthorized): set "
                        "HF_TOKEN to a valid token with write access, or run `hf auth login`")
    if status == 403:
        return HubError(f"the token has no write access to {upload.repo_id} at {upload.endpoint} while trying to "
                        f"{what} (403 Forbidden): use a token with write scope for that namespace")
    if isinstance(err, HfHubHTTPError):
        return HubError(f"the Hub at {where} refused to {what} (HTTP {status}): {err}")
    return HubError(f"could not reach the Hub at {where} to {what} ({type(err).__name__}: {err})")


def upload_folder(folder: Path, files: list[str], upload: Upload, token: str | None = None) -> str:
    """Upload `files` (names relative to `folder`) to `upload.repo_id` in one commit; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    api = HfApi(endpoint=upload.endpoint, token=token)
    step = "create the repo"
    try:
        try:
            api.create_repo(upload.repo_id, repo_type="model", private=upload.private)
        except HfHubHTTPError as err:
            if getattr(err.response, "status_code", None) != 409:  # 409: it exists already
                raise
            step = "read the repo's visibility"
            if upload.private and not api.repo_info(upload.repo_id, repo_type="model").private:
                raise HubError(f"{upload.repo_id} already exists at {upload.endpoint} and is public: --private would "
                               "not make its files private; make the repo private on the Hub first, or drop "
                               "--private") from None
        if upload.revision != "main":
            step = f"create the branch {upload.revision!r}"
            api.create_branch(upload.repo_id, branch=upload.revision, repo_type="model", exist_ok=True)
        step = "commit the files"
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in files]
        info = api.create_commit(upload.repo_id, operations=operations, commit_message=upload.commit_message,
                                 repo_type="model", revision=upload.revision)
    except HubError:
        raise
    except Exception as err:  # noqa: BLE001 - HTTP and connection errors alike become one clear message
        raise _explain(err, upload, step) from err
    return str(info.commit_url)


__all__ = ["HubError", "Upload", "plan_upload", "upload_folder"]
