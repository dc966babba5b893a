"""llama.cpp, the engine CPU users run: the pinned build, a head as the GGUF llama-server drafts with, and
llama-server processes (token ids in; tokens, timings and draft counts out).

    root = build()                                    # once: ~/.cache/eaglekit/llama.cpp-0.3.36 (bin/, converter)
    export_head(head, "out/", "llama.cpp")            # eaglekit.export: out/head-f16.gguf via llama.cpp's converter
    with Server(target_gguf, draft=gguf, n_max=3) as s:
        r = s.complete(ids, n_predict=128)            # r.tokens, r.tokens_per_s, r.draft_n, r.accepted, r.tau

The source is the llama-cpp-python sdist's vendor/llama.cpp (only the package registry is needed); the build
is native, so the cache is stamped with this CPU's flags and another CPU rebuilds. The stamp also carries what
eaglekit changes in the build (``BUILD_CHANGES``: ggml's AMX kernels left out, one line in the Qwen2 graph), so a
cache made before a change rebuilds; the build ends with a smoke test (llama-server starts and decodes). What llama.cpp's EAGLE-3
(``--spec-type draft-eagle3``) can represent is narrower than what eaglekit trains: one decoder layer, three
taps, ``norm_before_fc`` or no norm before ``fc`` (not per-tap ``fc_norm``), the pre-norm feature fed back
(not ``norm_output``). ``refusal`` names what else a head would need; export_head asks it before writing.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from eaglekit import assets
from eaglekit.engines.server import DraftCounts, ServerProcess, free_port, plain_model_dir, run, stamped
from eaglekit.fileio import made_once, publish_dir

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors the llama.cpp we build
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
BINARIES = ("llama-server", "llama-quantize")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # what the converter writes (--outtype); q8_0 halves f16's bytes
SERVABLE = ("head.kind=eagle3 head.num_layers=1 head.fc_norm=false head.norm_output=false "
            "(head.norm_before_fc=true for a norm over the taps) and three taps")


# ggml (every kernel a token's arithmetic runs) builds at Release's -O3; llama's graph building and sampler, the
# server and its common library at -O1 (a later flag GCC obeys), those in unity batches of 16 files (each of their
# files parses the same large JSON and server headers; common/json.cpp redefines a name its batch shares, so it is
# compiled alone); the multimodal library llama-server links but text never runs, and the HTTP parser (once per
# request), at -O0, the multimodal library's files in one unity file (its helpers, a public library that may not
# see its internals, apart). Why: the build is most of a cold suite's CPU on 2 cores, and each step cut its CPU
# time without changing decoding speed or tokens (the figures: benchmarks/RESULTS.md, "Figures the code's comments
# used to carry"). llama's core files join its unity batches too (upstream leaves them out; they compile together).
LIGHT_OPTIMISATION = """include_guard(GLOBAL)
function(_eaglekit_light_optimisation)
  foreach(t llama llama-common server-context llama-server-impl llama-server llama-quantize)
    if(TARGET ${t})
      target_compile_options(${t} PRIVATE -O1)
      set_target_properties(${t} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16)
    endif()
  endforeach()
  if(TARGET llama-common)
    set_source_files_properties("${CMAKE_SOURCE_DIR}/common/json.cpp" TARGET_DIRECTORY llama-common
                                PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
  if(TARGET mtmd)  # its ~50 small model files, each parsing the same headers, as one unity file
    set_target_properties(mtmd PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)
    set_source_files_properties("${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper.cpp"
                                "${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper-gen.cpp"
                                TARGET_DIRECTORY mtmd PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endif()
  if(TARGET llama)  # upstream batches only its model files; its ~30 core files join them (93 -> 64 CPU-s)
    get_target_property(_sources llama SOURCES)
    foreach(s ${_sources})
      set_source_files_properties("${CMAKE_SOURCE_DIR}/src/${s}" TARGET_DIRECTORY llama
                                  PROPERTIES SKIP_UNITY_BUILD_INCLUSION OFF)
    endforeach()
  endif()
  foreach(t mtmd cpp-httplib)
    if(TARGET ${t})
      target_compile_options(${t} PRIVATE -O0)
    endif()
  endforeach()
endfunction()
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _eaglekit_light_optimisation)
"""


# What eaglekit changes in the pinned build, each small enough to read here; all of it is in the stamp.
#
# 1. No ggml AMX kernels. On an Intel Xeon with AMX, -march=native compiles ggml-cpu/amx (a buffer type that
#    repacks quantised weights at load for AMX tile matmuls), and llama-server dies with SIGSEGV in its first
#    decode, inside ggml_backend_amx_mul_mat (seen on an AMX VM: benchmarks/RESULTS.md; upstream #20824, closed stale
#    without a fix, and open PR #26954: ggml_amx_init asks the kernel for tile-data permission on the main thread
#    only while worker threads run the tile instructions, and the tile configuration built on the stack can be
#    optimised away). The tile kernels are an optional faster path: without them the same quantised matmuls run
#    on the AVX-512 VNNI / AVX2 kernels every other CPU uses. GCC keeps an explicit -mno-* over -march=native,
#    so __AMX_INT8__ is never defined and ggml compiles no AMX code (amx.h and ggml-cpu.cpp test that macro).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# 2. Qwen2 / Qwen2.5's graph records its layer inputs. llama.cpp's EAGLE-3 and DSpark drafts read the target's
#    layer inputs (res->t_layer_inp), which a graph records only where upstream added the line for it, one
#    architecture at a time as users hit llama-server's "layer input tensor is null" (#24593 qwen35, #25141
#    qwen3next, #25604 minimax-m2); qwen2 has no such change. The line below is what llama.cpp's llama.cpp and
#    qwen3.cpp graphs have as the first statement of their layer loop: it only names a tensor the graph
#    computes anyway, so plain decoding is unchanged.
PATCHES = (("src/models/qwen2.cpp", "    for (int il = 0; il < n_layer; ++il) {\n",
            "        res->t_layer_inp[il] = inpL;\n"),)
BUILD_CHANGES = hashlib.sha256(repr((NO_AMX, PATCHES)).encode()).hexdigest()[:12]


class LlamaCppError(RuntimeError):
    """The pinned llama.cpp could not be built, a head cannot be served by it, or a server failed."""


# ---- the pinned build ----------------------------------------------------------------------------------
def install_dir() -> Path:
    return assets.cache_dir() / f"llama.cpp-{VERSION}"


def _stamp() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    return (f"llama-cpp-python=={VERSION} {SDIST_SHA256} changes={BUILD_CHANGES} "
            f"cpu={hashlib.sha256(flags.encode()).hexdigest()[:16]}")


def installed() -> Path | None:
    """The cached build if it is whole and was made on this kind of CPU, else None."""
    return stamped(install_dir(), ".built", _stamp(), [f"bin/{b}" for b in BINARIES])


def build(jobs: int | None = None, log=sys.stderr) -> Path:
    """Build llama-server and llama-quantize from the pinned sdist into the cache, once; return the folder.
    A build already under way in another process (``bash scripts/test.sh`` starts one beside its setup) is
    waited for, not repeated."""
    return made_once(install_dir(), installed, lambda: _build(jobs, log))


def _build(jobs: int | None, log) -> Path:
    for tool in ("cmake", "gcc", "g++"):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"building llama.cpp needs '{tool}' on PATH")
    root = install_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    print(f"eaglekit: building llama.cpp from llama-cpp-python=={VERSION} into {root} (once; ~3 min on 2 cores)",
          file=log, flush=True)
    with tempfile.TemporaryDirectory(prefix="eaglekit-llama-cpp-") as work:
        work = Path(work)
        # the sdist, never a wheel; pip reads its metadata in an isolated build environment (scikit-build-core
        # from the registry, as a wheel: --no-build-isolation would need it installed beside eaglekit)
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={VERSION}", "-d", str(work)], "pip download", log)
        sdist = work / f"llama_cpp_python-{VERSION}.tar.gz"
        if assets.sha256_of(sdist) != SDIST_SHA256:
            raise LlamaCppError(f"{sdist}: sha256 is not the pinned {SDIST_SHA256}")
        inner = f"llama_cpp_python-{VERSION}/vendor/llama.cpp"
        with tarfile.open(sdist) as tar:
            tar.extractall(work, members=[m for m in tar.getmembers() if m.name.startswith(inner)], filter="data")
        src = work / inner
        apply_patches(src)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        (work / "light.cmake").write_text(LIGHT_OPTIMISATION)
        flags = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"] if _x86() else []
        _run(["cmake", "-S", str(src), "-B", str(work / "build"), *gen, "-DCMAKE_BUILD_TYPE=Release",
              "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DBUILD_SHARED_LIBS=OFF", f"-DCMAKE_PROJECT_INCLUDE={work / 'light.cmake'}", *flags], "cmake", log)
        _run(["cmake", "--build", str(work / "build"), "--target", *BINARIES, "-j", str(jobs or os.cpu_count() or 2)],
             "cmake --build", log)
        return _install(work / "build" / "bin", src, root, log)


def _install(bin_dir: Path, src: Path, root: Path, log=sys.stderr) -> Path:
    """Copy the built binaries and the converter into a folder beside ``root``, smoke-test it, then publish it
    as ``root``; on any failure the folder is removed (nothing half-made stays in the cache)."""
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=root.name + ".tmp"))
    try:
        (tmp / "bin").mkdir()
        for b in BINARIES:
            shutil.copy2(bin_dir / b, tmp / "bin" / b)
        for part in ("gguf-py", "conversion"):  # the converter and what it imports
            if (src / part).is_dir():
                shutil.copytree(src / part, tmp / part)
        shutil.copy2(src / "convert_hf_to_gguf.py", tmp / "convert_hf_to_gguf.py")
        (tmp / SERVABLE_FILE).write_text(json.dumps(read_servable(src), indent=1, sort_keys=True) + "\n")
        smoke_test(tmp, log)
        (tmp / ".built").write_text(_stamp() + "\n")  # last: its presence means the folder is whole
        shutil.rmtree(root, ignore_errors=True)
        publish_dir(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once published
    return root


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def apply_patches(src: Path) -> None:
    """Insert each of ``PATCHES``' lines after its anchor, which must occur exactly once in the pinned file."""
    for rel, anchor, line in PATCHES:
        path = src / rel
        text = path.read_text()
        if anchor + line in text:  # applied already
            continue
        if text.count(anchor) != 1:
            raise LlamaCppError(f"{path}: the line eaglekit patches after ({anchor.strip()!r}) occurs "
                                f"{text.count(anchor)} times, not once; the pinned source is not the expected one")
        path.write_text(text.replace(anchor, anchor + line))


def smoke_test(root: Path, log=sys.stderr) -> None:
    """llama-server from ``root`` starts on the embedded SmolLM2 (a Q4_1 file, whose quantised matmuls are what
    the AMX crash hit) and greedily decodes 4 tokens; a build that cannot do that fails here, naming the cause."""
    model = assets.asset_file(assets.DEFAULT_TARGET)
    try:
        with Server(model, root=root, threads=2, ctx=256, timeout=120) as server:
            got = server.complete([1, 9690, 198, 19556, 17], n_predict=4)
    except LlamaCppError as e:
        raise LlamaCppError(f"the new build of llama.cpp fails its smoke test (llama-server on {model}): {e}") from e
    if len(got.tokens) != 4:
        raise LlamaCppError(f"the new build's llama-server decoded {got.tokens} for 4 tokens on {model}")
    print(f"eaglekit: llama.cpp smoke test passed (4 tokens at {got.tokens_per_s:.1f} tok/s)", file=log, flush=True)


def _converter_hint(output: str) -> str | None:
    if missing := re.search(r"No module named '([\w.]+)'", output):  # the converter's imports
        return (f"the converter needs the Python package {missing.group(1)!r}: install eaglekit's llama-cpp "
                "extra (pip install 'eaglekit[llama-cpp]')")
    return None


def _run(cmd: list[str], what: str, log=sys.stderr, env=None) -> None:
    run(cmd, what, log, env, error=LlamaCppError, hint=_converter_hint)


def require(build_if_missing: bool = True) -> Path:
    root = installed()
    if root is None and build_if_missing:
        root = build()
    if root is None:
        raise LlamaCppError(f"llama.cpp is not built here; run `bash scripts/llama_cpp.sh` (builds into {install_dir()})")
    return root


# ---- what llama.cpp can serve, and the export -------------------------------------------------------------
def refusal(cfg) -> str | None:
    """Why llama.cpp's EAGLE-3 cannot run a head of config ``cfg`` as trained (None: it can)."""
    why = []
    if cfg.kind == "dspark":  # --spec-type draft-dspark, through speculators' dspark layout
        why = _taps_refusal(cfg)
        return f"llama.cpp cannot serve this dspark head: {why}" if why else None
    if cfg.kind in ("dflash", "dflash2"):  # --spec-type draft-dflash (DFlash 2's selector walked greedily)
        return _dflash_refusal(cfg)
    if cfg.kind != "eagle3":
        return (f"llama.cpp serves EAGLE-3, DSpark, DFlash and DFlash 2 heads through eaglekit; this is a {cfg.kind} "
                "head, which llama.cpp has no loader for")
    if cfg.fc_norm:
        why.append("head.fc_norm=true (llama.cpp has one norm over all taps, norm_before_fc, not one per tap)")
    if cfg.norm_output:
        why.append("head.norm_output=true (llama.cpp feeds the pre-norm hidden state to the next draft step)")
    if cfg.train_embedding:
        why.append("head.train_embedding=true (eaglekit has not checked llama.cpp's converter with a draft's own "
                   "embedding)")
    if cfg.num_layers != 1:
        why.append(f"head.num_layers={cfg.num_layers} (llama.cpp's EAGLE-3 has one decoder layer)")
    if len(cfg.aux_layer_ids) != 3 or len(set(cfg.aux_layer_ids)) != 3:
        why.append(f"taps {cfg.aux_layer_ids} (llama.cpp extracts exactly three distinct layers)")
    if not why:
        return None
    return "llama.cpp cannot serve this head as trained: " + "; ".join(why) + f". Train a servable head with {SERVABLE}"


def _taps_refusal(cfg) -> str | None:
    """DSpark's and DFlash's converters write the taps as layer outputs (tap - 1) and llama.cpp extracts them
    in order: each tap must be >= 1 and they must increase."""
    taps = list(cfg.aux_layer_ids)
    if min(taps) < 1 or taps != sorted(set(taps)):
        return f"taps {taps} (it extracts distinct layers in order, written as layer outputs, so tap 0 has no id)"
    return None


def _dflash_refusal(cfg) -> str | None:
    """What the pinned converter's DFlash class and src/models/dflash.cpp need of a DFlash or DFlash 2 head (None:
    all of it). DFlash 2's own config already refuses a draft vocabulary and head.mask_embedding."""
    why = [taps] if (taps := _taps_refusal(cfg)) else []
    if cfg.draft_vocab_size < cfg.target_vocab_size:  # its DSpark class maps d2t; its DFlash class has no such code
        why.append(f"head.draft_vocab_size={cfg.draft_vocab_size} below the target's {cfg.target_vocab_size} (the "
                   "converter writes no d2t table for DFlash: train with the full vocabulary)")
    if cfg.mask_embedding:
        why.append("head.mask_embedding=true (the converter would read mask_embedding.pt into an embedding of the "
                   "draft's own; eaglekit has not checked that path)")
    k = cfg.selector_top_k  # DFlash 2's graph refuses: "hidden size is too small for the selector lattice"
    if cfg.kind == "dflash2" and cfg.hidden_size < k * (k + 1):
        why.append(f"hidden size {cfg.hidden_size} < selector_top_k * (selector_top_k + 1) = {k * (k + 1)}")
    return f"llama.cpp cannot serve this {cfg.kind} head: " + "; ".join(why) if why else None


# llama.cpp's EAGLE-3 and DSpark drafts read the target's layer inputs, which only some target graphs record
# (src/models/*.cpp setting res->t_layer_inp); for any other, llama-server aborts on its first batch ("layer
# input tensor is null"). The build reads which from the pinned source it compiled (patches applied) into
# SERVABLE_FILE: {GGUF general.architecture: [transformers architectures its converter writes as it]}.
SERVABLE_FILE = "servable.json"


def read_servable(src: Path) -> dict[str, list[str]]:
    """The architectures whose graph in the llama.cpp source tree ``src`` records its layer inputs."""
    classes = set()
    for f in sorted((src / "src" / "models").glob("*.cpp")):
        text = f.read_text(errors="replace")
        if "t_layer_inp[" in text:  # the graphs built in this file record them
            classes |= set(re.findall(r"\bllama_model_(\w+)::(?:graph::graph|build_arch_graph)\b", text))
    enums = set()  # llama-model.cpp: case LLM_ARCH_A: [case LLM_ARCH_B: ...] return new llama_model_x(params);
    mapping = (src / "src" / "llama-model.cpp").read_text(errors="replace")
    for cases, cls in re.findall(r"((?:case\s+LLM_ARCH_\w+:\s*)+)return new llama_model_(\w+)\(", mapping):
        if cls in classes:
            enums |= set(re.findall(r"LLM_ARCH_(\w+)", cases))
    names = dict(re.findall(r'\{\s*LLM_ARCH_(\w+),\s*"([^"]+)"\s*\}', (src / "src" / "llama-arch.cpp").read_text()))
    servable = {names[e]: set() for e in enums if e in names}
    # the converter: @ModelBase.register("HfArch", ...) on a class whose model_arch is gguf.MODEL_ARCH.X
    gguf_names = dict(re.findall(r'MODEL_ARCH\.(\w+):\s*"([^"]+)"',
                                 (src / "gguf-py" / "gguf" / "constants.py").read_text()))
    for f in [src / "convert_hf_to_gguf.py", *sorted((src / "conversion").glob("*.py"))]:
        text = f.read_text(errors="replace")
        for regs, body in re.findall(r"@ModelBase\.register\(([^)]*)\)\s*(?:[@#][^\n]*\n\s*)*class \w+[^\n]*\n(.*?)"
                                     r"(?=\n@|\nclass |\Z)", text, re.DOTALL):
            arch = re.search(r"^\s+model_arch\s*=\s*gguf\.MODEL_ARCH\.(\w+)", body, re.MULTILINE)
            if arch and gguf_names.get(arch.group(1)) in servable:
                servable[gguf_names[arch.group(1)]] |= set(re.findall(r'"([^"]+)"', regs))
    return {arch: sorted(hf) for arch, hf in sorted(servable.items())}


def servable(root: Path | None = None) -> dict[str, list[str]]:
    """``read_servable`` of the pinned build in ``root`` (default: the cached build, built if missing)."""
    root = root or require()
    try:
        return json.loads((root / SERVABLE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LlamaCppError(f"{root / SERVABLE_FILE}: cannot read which targets llama-server drafts for ({e}); "
                            f"rebuild (remove {root})") from e


def _untapped(arch: str, what: str, table: dict[str, list[str]]) -> str:
    tapped = ", ".join(f"{a} ({', '.join(hf)})" if hf else a for a, hf in table.items())
    return (f"llama.cpp {VERSION} cannot draft for {what}: its EAGLE-3 / DSpark drafts read the target's layer "
            f"inputs, which its {arch} graph does not record (llama-server aborts: 'layer input tensor is null'); "
            f"it can for GGUF architectures (transformers architectures): {tapped}")


def target_refusal(target_dir, root: Path | None = None) -> str | None:
    """Why llama-server cannot draft with a head for the transformers target in ``target_dir`` (None: it can)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    table = servable(root)
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if any(a in hf for a in archs for hf in table.values()):
        return None
    return _untapped(archs[0], f"a {archs[0]} target ({target_dir})", table)


def gguf_architecture(model) -> str:
    arch = assets.gguf_fields(model, ["general.architecture"]).get("general.architecture")
    if arch is None:
        raise LlamaCppError(f"{model}: the GGUF file names no general.architecture")
    return arch


def check_draft_target(model, root: Path | None = None) -> None:
    """Refuse the target GGUF ``model`` if llama-server cannot draft for it with a head (its architecture)."""
    arch, table = gguf_architecture(model), servable(root)
    if arch not in table:
        raise LlamaCppError(_untapped(arch, f"the {arch} target {model}", table))


def export_gguf(layout_dir, out_dir, target_dir, outtype: str = "f16", overwrite: bool = False,
                root: Path | None = None) -> Path:
    """Convert an EAGLE-3 head written in the vLLM layout (``layout_dir``: its taps, ``d2t``) into the GGUF
    llama-server takes with ``-md`` (``out_dir/head-<outtype>.gguf``) with llama.cpp's own converter, the
    target's tokenizer read from ``target_dir`` (its transformers folder). export_head checks
    ``refusal`` first and writes ``layout_dir``; the file appears under its name only once whole."""
    if outtype not in GGUF_TYPES:
        raise LlamaCppError(f"gguf type {outtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise LlamaCppError(f"{target_dir}: the converter reads the target's config.json and tokenizer from a "
                            "local transformers folder; none there")
    out = Path(out_dir) / f"head-{outtype}.gguf"
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite)")
    root = root or require()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        convert(layout_dir, tmp, outtype, target_dir, root)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def convert(model_dir, out_file, outtype: str = "f16", target_dir=None, root: Path | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a transformers folder (a draft with ``target_dir``, or a target),
    read through ``plain_model_dir``."""
    root = root or require()
    with plain_model_dir(model_dir) as plain:
        if plain != Path(model_dir):
            return convert(plain, out_file, outtype, target_dir, root)
    cmd = [sys.executable, str(root / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out_file),
           "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    if lacks_mtp(model_dir):
        cmd += ["--no-mtp"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    _run(cmd, f"convert_hf_to_gguf.py {model_dir}", env=env)
    return Path(out_file)


# The pinned converter's Qwen3-Next / Qwen3.5 classes (conversion/qwen.py _QwenMtpMixin; only they take --no-mtp)
# add MTP layers unless told --no-mtp: for a checkpoint without mtp.* tensors, an assert or a GGUF llama-server refuses.
MTP_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                     "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


def lacks_mtp(model_dir) -> bool:
    """Whether ``model_dir`` is a Qwen3-Next / Qwen3.5 checkpoint holding no MTP tensors (which ``convert``
    converts with --no-mtp). False where its tensor names cannot be read (no safetensors file or index)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    if not set(cfg.get("architectures") or ()) & set(MTP_ARCHITECTURES):
        return False
    names: set[str] = set()
    for index in model_dir.glob("*.index.json"):
        names |= set(json.loads(index.read_text()).get("weight_map", {}))
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as r:  # the header's names only: no tensor is read
            names |= set(r.keys())
    return bool(names) and not any(re.search(r"(?:^|\.)mtp\.", n) for n in names)


def quantize(src, dst, qtype: str, root: Path | None = None) -> Path:
    """llama-quantize ``src`` into ``dst`` as ``qtype`` (e.g. Q8_0, Q4_K_M), written under a temporary name."""
    root = root or require()
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    _run([str(root / "bin" / "llama-quantize"), str(src), str(tmp), qtype], f"llama-quantize {qtype}")
    os.replace(tmp, dst)
    return dst


# ---- llama-server --------------------------------------------------------------------------------------------
@dataclass
class Completion(DraftCounts):
    tokens: list[int]
    timings: dict = field(default_factory=dict)
    top: list[dict[int, float]] = field(default_factory=list)  # with n_probs: each token's top log-probabilities

    @property
    def tokens_per_s(self) -> float:
        return float(self.timings.get("predicted_per_second", 0.0))

    @property
    def draft_n(self) -> int:
        return int(self.timings.get("draft_n", 0))

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted", 0))


class Server(ServerProcess):
    """A llama-server process on 127.0.0.1 (a context manager): the target GGUF, optionally a draft.

    ``spec_type``: llama.cpp's ``--spec-type`` (``draft-eagle3`` when ``draft`` is an EAGLE-3 head, plain
    ``draft-simple`` for a draft model, ``ngram-mod`` ...); ``n_max`` / ``p_min``: ``--spec-draft-n-max`` /
    ``--spec-draft-p-min``. One slot, no prompt cache between requests, greedy requests."""

    def __init__(self, model, draft=None, spec_type: str | None = None, n_max: int | None = None,
                 p_min: float | None = None, threads: int | None = None, ctx: int = 4096, extra=(),
                 root: Path | None = None, timeout: float = 180.0):
        self.root = root or require()
        if draft is not None and spec_type in ("draft-eagle3", "draft-dspark", "draft-dflash"):  # before any process
            check_draft_target(model, self.root)
        self.port = free_port()
        cmd = [str(self.root / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "-c", str(ctx), "-np", "1", "-t", str(threads or os.cpu_count() or 1),
               "--no-webui", "--no-warmup"]
        if draft is not None:
            cmd += ["-md", str(draft)]
        if spec_type is not None:
            cmd += ["--spec-type", spec_type]
        if n_max is not None:
            cmd += ["--spec-draft-n-max", str(n_max)]
        if p_min is not None:
            cmd += ["--spec-draft-p-min", str(p_min)]
        self.cmd, self.timeout = [*cmd, *map(str, extra)], timeout

    name, error = "llama-server", LlamaCppError

    def complete(self, ids, n_predict: int, cache_prompt: bool = False, timeout: float = 900.0,
                 n_probs: int = 0) -> Completion:
        """Greedy completion of the token ids ``ids`` (the prompt already in the chat template), up to
        ``n_predict`` tokens or the model's end-of-generation token. ``cache_prompt``: reuse the slot's KV of
        the previous request's common prefix (off: every request is prefilled whole). ``n_probs``: also return
        each position's top ``n_probs`` log-probabilities before sampling (``Completion.top``)."""
        body = {"prompt": [int(i) for i in ids], "n_predict": int(n_predict), "temperature": 0.0,
                "top_k": 1, "n_probs": int(n_probs),
                "cache_prompt": cache_prompt, "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                res = json.loads(r.read())
        except OSError as e:
            raise LlamaCppError(f"llama-server request failed ({e}): {self.tail()}") from e
        top = [{int(p["id"]): float(p["logprob"]) for p in pos.get("top_logprobs", [])}
               for pos in res.get("completion_probabilities", [])]
        return Completion(tokens=[int(t) for t in res.get("tokens", [])], timings=res.get("timings", {}), top=top)


if __name__ == "__main__":  # scripts/llama_cpp.sh: build once, print the folder
    print(build())
