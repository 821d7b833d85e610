"""`dflash-export --push-to-hub` against a local stand-in of the Hugging Face Hub HTTP API on loopback: the real
`huggingface_hub` client (pointed at it through its endpoint setting) creates the repo, asks the upload
modes, uploads the weights through the LFS batch protocol and sends one NDJSON commit. What arrives is
compared byte for byte with the export on disk; the private flag, a branch revision and auth failures are
checked. (The stand-in speaks the plain LFS protocol: the tests switch huggingface_hub's Xet transfer off,
which a real upload uses when hf_xet is installed.)"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest
from test_export import _drafter_that_drafts, _make_run

from dflash.export.hub import HubError
from dflash.export.run import ExportLayout, HubPush, export_run

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


GOOD_TOKEN = "hf_good_token_for_the_stand_in"


class StandInHub:
    """The Hub endpoints one upload uses, in memory: repos (visibility, branches, commits), LFS objects."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, status: int, body: dict | None = None):
                data = json.dumps(body or {}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {GOOD_TOKEN}":
                    return True
                self._reply(401, {"error": "Invalid credentials in Authorization header"})
                return False

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                if not self._authorized():
                    return
                parts = unquote(self.path.split("?")[0]).strip("/").split("/")
                if parts[:2] == ["api", "models"] and "/".join(parts[2:4]) in hub.repos:
                    repo = hub.repos["/".join(parts[2:4])]
                    return self._reply(200, {"id": "/".join(parts[2:4]), "private": repo["private"],
                                             "sha": repo["branches"]["main"]})
                self._reply(404, {"error": "Repository not found"})

            def do_PUT(self):
                hub.requests.append(("PUT", self.path))
                oid = self.path.rsplit("/", 1)[-1]
                data = self._body()
                if hashlib.sha256(data).hexdigest() != oid:
                    return self._reply(400, {"error": "sha256 mismatch"})
                hub.lfs[oid] = data
                self._reply(200)

            def do_POST(self):
                hub.requests.append(("POST", self.path))
                path = unquote(self.path.split("?")[0])
                body = self._body()
                if path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                if not self._authorized():
                    return
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo_id = f"{req.get('organization') or 'me'}/{req['name']}"
                    if repo_id in hub.repos:
                        return self._reply(409, {"error": "You already created this model repo"})
                    hub.repos[repo_id] = {"private": req.get("visibility") == "private", "branches": {"main": "0" * 40},
                                          "commits": []}
                    return self._reply(200, {"url": f"{hub.url}/{repo_id}"})
                if path.endswith(".git/info/lfs/objects/batch"):
                    req = json.loads(body)
                    objects = [{"oid": o["oid"], "size": o["size"], "authenticated": True,
                                "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}}
                               for o in req["objects"]]
                    return self._reply(200, {"transfer": "basic", "objects": objects})
                parts = path.strip("/").split("/")
                repo_id = "/".join(parts[2:4])
                if parts[:2] != ["api", "models"] or repo_id not in hub.repos:
                    return self._reply(404, {"error": "Repository not found"})
                repo, action, revision = hub.repos[repo_id], parts[4], "/".join(parts[5:])
                if action == "branch":
                    if revision in repo["branches"]:
                        return self._reply(409, {"error": "branch exists"})
                    repo["branches"][revision] = repo["branches"]["main"]
                    return self._reply(200)
                if revision not in repo["branches"]:
                    return self._reply(404, {"error": f"Revision {revision} not found"})
                if action == "preupload":
                    files = [{"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(".safetensors") else
                              "regular", "shouldIgnore": False} for f in json.loads(body)["files"]]
                    return self._reply(200, {"files": files})
                if action == "commit":
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    files, lfs_files = {}, []
                    for line in lines[1:]:
                        value = line["value"]
                        if line["key"] == "file":
                            files[value["path"]] = base64.b64decode(value["content"])
                        elif line["key"] == "lfsFile":
                            if value["oid"] not in hub.lfs:
                                return self._reply(400, {"error": f"LFS object of {value['path']} was never uploaded"})
                            files[value["path"]] = hub.lfs[value["oid"]]
                            lfs_files.append(value["path"])
                    sha = hashlib.sha1(body).hexdigest()
                    repo["branches"][revision] = sha
                    repo["commits"].append({"revision": revision, "message": lines[0]["value"]["summary"],
                                            "files": files, "lfs": lfs_files})
                    return self._reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha,
                                             "pullRequestUrl": None})
                self._reply(404, {"error": f"no such endpoint {path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    server = StandInHub()
    yield server
    server.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from flax import nnx  # noqa: F401
    from test_export import REPEATED, TARGET_DIR

    from dflash.models.drafter import DrafterConfig, resolve_drafter
    from dflash.models.loading import load_hf_dir

    target_cfg, target_params = load_hf_dir(TARGET_DIR)
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 2), block_size=4,
                                         mask_token_id=255), target_cfg)
    return _make_run(tmp_path_factory.mktemp("hubruns") / "tiny_run", _drafter_that_drafts(arch, target_params,
                                                                                            REPEATED))


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_files_arrive_in_one_private_commit(hub, run_dir, tmp_path):
    result = export_run(run_dir, ExportLayout("zlab"), out=tmp_path / "out",
                        hub=HubPush("alice/tiny-dflash", private=True, endpoint=hub.url, token=GOOD_TOKEN),
                        say=lambda _: None)
    repo = hub.repos["alice/tiny-dflash"]
    assert repo["private"] is True
    assert len(repo["commits"]) == 1
    commit = repo["commits"][0]
    assert commit["revision"] == "main" and commit["message"] == "dflash-export: tiny_run step 3, zlab layout, float32"
    assert commit["files"] == _files(tmp_path / "out")  # byte for byte what was written locally
    assert commit["lfs"] == ["model.safetensors"]
    assert result.commit_url.startswith(f"{hub.url}/alice/tiny-dflash/commit/")
    assert "\"model\": \"alice/tiny-dflash\"" in commit["files"]["README.md"].decode()  # the card names the repo


def test_a_revision_goes_to_its_branch_and_the_token_comes_from_hf_token(hub, run_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    export_run(run_dir, ExportLayout("speculators"), hub=HubPush("alice/spec", endpoint=hub.url), say=lambda _: None)
    export_run(run_dir, ExportLayout("speculators"), hub=HubPush("alice/spec", revision="v1", endpoint=hub.url),
               say=lambda _: None)
    repo = hub.repos["alice/spec"]
    assert repo["private"] is False and [c["revision"] for c in repo["commits"]] == ["main", "v1"]
    assert set(repo["branches"]) == {"main", "v1"}
    assert sorted(repo["commits"][1]["files"]) == ["README.md", "config.json", "model.safetensors"]


def test_private_is_honoured_for_an_existing_public_repo(hub, run_dir):
    export_run(run_dir, ExportLayout("zlab"), hub=HubPush("alice/public", endpoint=hub.url, token=GOOD_TOKEN),
               say=lambda _: None)
    with pytest.raises(HubError, match="already exists .* and is public: --private would not make its files private"):
        export_run(run_dir, ExportLayout("zlab"),
                   hub=HubPush("alice/public", private=True, endpoint=hub.url, token=GOOD_TOKEN), say=lambda _: None)
    assert len(hub.repos["alice/public"]["commits"]) == 1


def test_an_auth_failure_is_a_clear_error(hub, run_dir, tmp_path, monkeypatch):
    with pytest.raises(HubError) as err:
        export_run(run_dir, ExportLayout("zlab"), hub=HubPush("alice/x", endpoint=hub.url, token="hf_wrong"),
                   say=lambda _: None)
    assert "rejected the token while trying to create the repo (401 Unauthorized)" in str(err.value)
    assert "HF_TOKEN" in str(err.value) and "hf auth login" in str(err.value)
    assert hub.repos == {}
    # No token at all: nothing is sent.
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    sent = len(hub.requests)
    with pytest.raises(HubError, match="no Hugging Face token: set HF_TOKEN or run `hf auth login`"):
        export_run(run_dir, ExportLayout("zlab"), hub=HubPush("alice/x", endpoint=hub.url), say=lambda _: None)
    assert len(hub.requests) == sent
    with pytest.raises(HubError, match="must name the owner"):
        export_run(run_dir, ExportLayout("zlab"), hub=HubPush("noowner", endpoint=hub.url, token=GOOD_TOKEN),
                   say=lambda _: None)


@pytest.mark.slow  # ~30 s, a subprocess: the in-process uploads above make the same requests; the nightly tier runs it
@pytest.mark.e2e
def test_the_console_script_uploads_through_hf_endpoint(hub, run_dir, tmp_path):
    """`dflash-export ... --push-to-hub` as a user runs it, huggingface_hub pointed at the stand-in by
    HF_ENDPOINT, the token in HF_TOKEN; then --dry-run sends nothing."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": GOOD_TOKEN, "HF_HUB_DISABLE_XET": "1",
           "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "0"}
    script = str(Path(sys.executable).parent / "dflash-export")
    done = subprocess.run([script, str(run_dir), "--format", "zlab", "--out", str(tmp_path / "o"), "--push-to-hub",
                           "bob/cli-dflash", "--private"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "uploaded to bob/cli-dflash (revision main)" in done.stdout
    assert hub.repos["bob/cli-dflash"]["private"] is True
    assert hub.repos["bob/cli-dflash"]["commits"][0]["files"] == _files(tmp_path / "o")
    sent = len(hub.requests)
    done = subprocess.run([script, str(run_dir), "--format", "zlab", "--push-to-hub", "bob/other", "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "would upload 3 files" in done.stdout and f"{hub.url}/bob/other (revision main, public)" in done.stdout
    assert len(hub.requests) == sent and "bob/other" not in hub.repos
