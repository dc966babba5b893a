"""``eaglekit push``: upload a head + model card to the Hub (token from HF_TOKEN or `hf auth login`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from eaglekit.config import TargetSpec
from eaglekit.export.cli import load_target_for, options
from eaglekit.export.hub import hub_token, push_head


@dataclass
class PushOptions:
    head: str = ""  # a saved head folder
    repo_id: str = ""
    layout: str = "native"  # native | sglang | vllm | speculators | eagle1
    private: bool = False
    datasets: list[str] = field(default_factory=list)  # Hub ids of the training data (model card)
    base_model: str = ""  # same as verifier (kept for older configs)
    verifier: str = ""  # the target's Hub id (model card base_model, speculators verifier); default: derived
    target: TargetSpec | None = None  # the head is checked against it before upload (default: the head's own)
    dry_run: bool = False


def add_arguments(p) -> None:
    p.add_argument("--head", help="saved head folder")
    p.add_argument("--repo-id", dest="repo_id", help="user/name on the Hub")
    p.add_argument("--layout", choices=["native", "sglang", "vllm", "speculators", "eagle1"])
    p.add_argument("--private", action="store_true", default=None)
    p.add_argument("--dataset", dest="datasets", action="append", help="training data Hub id (repeatable)")
    p.add_argument("--verifier", help="the target's Hub id, ORG/NAME (default: the embedded target's id)")
    p.add_argument("--base-model", dest="base_model", help="same as --verifier")
    p.add_argument("--target")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", default=None,
                   help="print the file list and model card; upload nothing")


def run(args) -> int:
    opts = options(args, PushOptions)
    if not opts.head or not opts.repo_id:
        raise SystemExit("eaglekit push: --head and --repo-id are required")
    token = None if opts.dry_run else hub_token()  # before loading anything
    target = load_target_for(opts.head, opts.target)  # every layout: the head is checked against it
    res = push_head(opts.head, opts.repo_id, private=opts.private, layout=opts.layout, target=target,
                      token=token, datasets=opts.datasets, verifier=opts.verifier or opts.base_model or None,
                      dry_run=opts.dry_run)
    print(("would upload" if opts.dry_run else "uploaded") + f" to {res['repo_id']}: " + ", ".join(res["files"]))
    if opts.dry_run:
        print(res["card"])
    elif res["url"]:
        print(res["url"])
    return 0
