"""How each serving engine / consumer reads an exported head, as data (the exporter writes from it).

Every fact below was read from the engine's own source at the version named, file:line given in
``sources``. eaglekit's tap ids count layer INPUTS (id k = the hidden state entering decoder layer k,
i.e. ``output_hidden_states[k]``); ``tap_offset`` converts them to the engine's meaning
(engine id = eaglekit id + offset).

Config paths are dotted (``"eagle_config.eagle_aux_hidden_state_layer_ids"``) from the top of
``config.json``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

TAP_KEY = "eagle_aux_hidden_state_layer_ids"


class ExportError(ValueError):
    """An export (or a folder read as one) whose keys, shapes or config do not match its layout, or a head
    a layout's engines cannot represent (re-exported by export.layouts and export.formats)."""


def need(ok: bool, msg: str) -> None:
    """Raise ExportError(msg) unless ``ok``."""
    if not ok:
        raise ExportError(msg)

EAGLE_CONFIG_TAPS = f"eagle_config.{TAP_KEY}"


@dataclass(frozen=True)
class Engine:
    name: str
    version: str
    architectures: tuple[str, ...]  # config "architectures" it accepts for this head ("" = ignored)
    tap_offset: int = 0  # engine tap id = eaglekit tap id (layer input) + tap_offset
    tap_ids_at: tuple[str, ...] = ()  # where it reads the tap ids, first present wins
    tap_count_at: tuple[str, ...] = ()  # where it reads how many taps fc takes (int, or a list's length)
    default_tap_count: int = 3  # fc width (in taps) when none of tap_count_at is present
    taps_sorted_unique: bool = True  # it captures each layer once, in layer order, whatever the id order
    flags: dict = field(default_factory=dict)  # head flag -> value the engine assumes when absent
    fixed: dict = field(default_factory=dict)  # head flag -> the only value it implements (flag not read)
    verifier_at: str = ""  # where it reads the verifier (target) model id
    verifier_must_be_hub_id: bool = False  # a local path there is refused
    key_map: dict = field(default_factory=dict)  # file-name prefix -> its module name in the engine
    notes: tuple[str, ...] = ()
    sources: dict = field(default_factory=dict)  # fact -> "file:line"
    # target (verifier) classes whose layer inputs it can capture for an EAGLE-3 head; () = not checked
    targets: tuple[str, ...] = ()


# the optional norms of an EAGLE-3 head (HeadConfig.fc_norm / norm_output: EAGLE 3.1; norm_before_fc: one norm
# over the concatenated taps): config.json fields of these names, False when absent
NORM_FLAGS = {"fc_norm": False, "norm_output": False, "norm_before_fc": False}
HEAD_FLAGS = ("norm_before_residual", *NORM_FLAGS)  # the flags an engine runs a head with (read_flag)

VLLM = "vLLM 0.33.0 (vllm-project/vllm, PyPI wheel vllm==0.33.0)"
# target classes that implement vLLM's SupportsEagle3 (the runner refuses any other, gpu_model_runner.py:5173);
# Mistral and Phi-3 subclass its Llama, OLMo-2 runs on its Transformers backend (which implements it)
VLLM_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "Qwen3MoeForCausalLM", "Olmo2ForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM",
                # the 2026 families: hybrids (one recurrent-state slot per speculative position, chains), DSA, Llama 4
                "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM", "NemotronHForCausalLM",
                "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Llama4ForCausalLM", "Llama4ForConditionalGeneration")
# target classes with SGLang's set_eagle3_layers_to_capture (else refused, attention_backend_setup.py:55-60);
# Mistral and Phi-3 subclass its Llama
SGLANG_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  "Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForCausalLM",
                  "Glm4MoeForCausalLM")
VLLM_TARGET_SOURCES = {
    "EAGLE-3 targets = SupportsEagle3 classes": "vllm/model_executor/models/llama.py:464, qwen2.py:458, qwen3.py:280, "
    "qwen3_moe.py:543, gpt_oss.py:1369, deepseek_v2.py:2005, mistral.py:236, phi3.py:10, transformers/base.py:109-117",
    "OLMo-2 on the Transformers backend": "vllm/model_executor/models/registry.py:762",
    "the 2026 families (read in eaglekit's vLLM 0.32.0 CPU environment)": "qwen3_5.py:298-305 (Qwen3_5ForCausalLMBase, "
    "taps (2, n//2, n-3) at :369-371), qwen3_5.py:473 + qwen3_vl.py:1938-1946 (the VL classes), qwen3_next.py:813-821, "
    "nemotron_h.py:720-726, llama4.py:708 (a LlamaForCausalLM), mllama4.py:728-735, deepseek_v2.py:1872-1879 and "
    ":2009 (GlmMoeDsa), "
    "vllm/models/deepseek_v32/nvidia/model.py:427 (a DeepseekV2ForCausalLM)",
    "others refused": "vllm/v1/worker/gpu_model_runner.py:5173-5177",
}
SGLANG = "SGLang 0.5.23 (sgl-project/sglang, PyPI wheel sglang==0.5.23)"
SPECULATORS = "speculators 0.9.0 (vllm-project/speculators, PyPI speculators==0.9.0)"
SAFEAILAB = "SafeAILab/EAGLE main @ cb7e084 (eagle/model/cnets1.py, EAGLE-1/2 draft)"

ENGINES: dict[str, Engine] = {e.name: e for e in [
    Engine(
        "vllm", VLLM, ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"),
        tap_offset=0, tap_ids_at=(TAP_KEY, EAGLE_CONFIG_TAPS),
        tap_count_at=("num_aux_hidden_states", EAGLE_CONFIG_TAPS),
        flags={"norm_before_residual": False, **NORM_FLAGS}, key_map={"midlayer.": "layers.0."},
        notes=(("d2t is renamed draft_id_to_target_id and t2d skipped; with draft vocab == target vocab "
                "the model has no draft_id_to_target_id, so d2t/t2d must be absent"),
               "embed_tokens.weight is optional (shared with the target when absent)"),
        sources={
            "tap ids read (top level, then eagle_config)": "vllm/v1/worker/gpu_model_runner.py:5207-5219",
            "captured layers = sorted(set(ids))": "vllm/model_executor/models/interfaces.py:1617",
            "id k = input of layer k (captured before layer k runs)": "vllm/model_executor/models/llama.py:428-441",
            "fc width = num_aux_hidden_states, else len(eagle_config ids), else 3":
                "vllm/model_executor/models/llama_eagle3.py:209-221",
            "norm_before_residual read (default False)": "vllm/model_executor/models/llama_eagle3.py:101-104",
            "midlayer. -> layers.0.": "vllm/model_executor/models/llama_eagle3.py:290-291",
            "d2t / t2d / embed_tokens handling": "vllm/model_executor/models/llama_eagle3.py:338-345,420-470",
            "architecture names": "vllm/model_executor/models/registry.py:700-702",
            "fc_norm read (default False): an RMSNorm per tap, applied before fc":
                "vllm/model_executor/models/llama_eagle3.py:231-240,409-416",
            "norm_output read (default False): the next step reads the post-norm hidden state":
                "vllm/model_executor/models/llama_eagle3.py:252,285-286",
            "fc_norm.N.weight loaded as model.fc_norm.N.weight": "vllm/model_executor/models/llama_eagle3.py:443-444",
            "norm_before_fc read (eagle_config, then top level; default False): one RMSNorm over the concatenated "
            "taps, weight input_norm.weight": "vllm/model_executor/models/llama_eagle3.py:184-188,223-229,405-407,464-465",
            **VLLM_TARGET_SOURCES,
        }, targets=VLLM_TARGETS),
    Engine(
        "sglang", SGLANG, ("LlamaForCausalLMEagle3",),
        tap_offset=-1, tap_ids_at=(EAGLE_CONFIG_TAPS,),
        tap_count_at=("num_aux_hidden_states", EAGLE_CONFIG_TAPS),
        fixed={"norm_before_residual": False}, flags=dict(NORM_FLAGS), key_map={"midlayer.": "layers.0."},
        notes=(("ids are read only from eagle_config; an id k there is the OUTPUT of layer k (it captures "
                "layer k+1's input); without eagle_config it captures the inputs of layers 2, N//2, N-3"),
               "the first layer's residual is always the fused feature g: norm_before_residual is not read",
               "d2t becomes hot_token_id; t2d and any unknown weight name are skipped silently"),
        sources={
            "tap ids read from eagle_config only":
                "python/sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py:185-196",
            "+1 on the ids (id = layer output)": "python/sglang/srt/models/llama.py:929-941 (qwen2.py:781-794)",
            "capture = the layer's input": "python/sglang/srt/models/llama.py:394-403,486-494",
            "fc width = num_aux_hidden_states, else len(eagle_config ids), else 3":
                "python/sglang/srt/models/llama_eagle3.py:156-167",
            "residual = g, no norm_before_residual": "python/sglang/srt/models/llama_eagle3.py:97-102",
            "midlayer -> layers.0, d2t/t2d, unknown names skipped":
                "python/sglang/srt/models/llama_eagle3.py:337-378",
            "fc_norm read (default False; legacy use_aux_norm), one RMSNorm per tap before fc":
                "python/sglang/srt/models/llama_eagle3.py:184-196,240-246",
            "norm_output read (default False): the next step reads the post-norm hidden state":
                "python/sglang/srt/models/llama_eagle3.py:207,267-269",
            "norm_before_fc read (eagle_config, then top level; default False), input_norm over the taps":
                "python/sglang/srt/models/llama_eagle3.py:173-182,239-240",
            "EAGLE-3 targets = classes with set_eagle3_layers_to_capture":
                "python/sglang/srt/models/llama.py:929,956, mistral.py:33, qwen2.py:781, qwen3.py:778, "
                "qwen3_moe.py:1128, gpt_oss.py:1337, deepseek_v2.py:3458,3518, gemma3_causal.py:917, "
                "glm4_moe.py:1269",
            "others refused": "python/sglang/srt/model_executor/model_runner_components/attention_backend_setup.py:55-60",
        }, targets=SGLANG_TARGETS),
    Engine(
        "speculators", SPECULATORS, ("Eagle3Speculator",),
        tap_offset=0, tap_ids_at=(TAP_KEY,), tap_count_at=(TAP_KEY,),
        flags={"norm_before_residual": False, **NORM_FLAGS},
        verifier_at="speculators_config.verifier.name_or_path",
        notes=(("from_pretrained reads the verifier's config (layer count) and its embed_tokens / lm_head "
                "/ final norm from verifier.name_or_path: a Hub id or a local model folder"),
               "tap ids must be distinct and within [0, verifier layers]"),
        sources={
            "fc width = len(eagle_aux_hidden_state_layer_ids) else 3": "speculators/models/eagle3/core.py:70-78",
            "verifier read on load": "speculators/models/eagle3/core.py:164-172, speculators/model.py:143-170",
            "distinct ids check": "speculators/models/utils.py:99-133",
            "norm_before_residual (default False)": "speculators/models/eagle3/config.py:43-46, "
                                                    "speculators/models/eagle3/model_definitions.py:73-81",
            "fc_norm / norm_output (default False)": "speculators/models/eagle3/config.py:66-84, "
                                                     "speculators/models/eagle3/core.py:130-140,238-243,302-306",
            "norm_before_fc (default False; exclusive with fc_norm), weight input_norm.weight":
                "speculators/models/eagle3/config.py:58-64,89-95, speculators/models/eagle3/core.py:122-128,236-237",
        }),
    Engine(
        "vllm-speculators", VLLM, ("Eagle3Speculator",),
        tap_offset=0, tap_ids_at=(TAP_KEY, f"transformer_layer_config.{EAGLE_CONFIG_TAPS}"),
        tap_count_at=("transformer_layer_config.num_aux_hidden_states",
                      f"transformer_layer_config.{EAGLE_CONFIG_TAPS}"),
        flags={"norm_before_residual": True, **NORM_FLAGS},
        verifier_at="speculators_config.verifier.name_or_path", verifier_must_be_hub_id=True,
        notes=(("vLLM builds the draft config from transformer_layer_config plus the top-level eagle3 "
                "fields; norm_before_residual defaults to TRUE on this path"),
               ("`vllm serve <export>` serves the verifier named in the config, which must be a Hub repo id; "
                "a local verifier needs --model + --speculative-config")),
        sources={
            "config = transformer_layer_config + eagle3 fields":
                "vllm/transformers_utils/configs/speculators/base.py:58-63, algos.py:15-50",
            "norm_before_residual default True": "vllm/transformers_utils/configs/speculators/algos.py:33-35",
            "verifier must be a Hub repo id": "vllm/transformers_utils/config.py:859-873",
            "tap ids read (top level, then eagle_config)": "vllm/v1/worker/gpu_model_runner.py:5207-5219",
            "fc width": "vllm/model_executor/models/llama_eagle3.py:209-221",
            "fc_norm / norm_output / norm_before_fc copied from the top level (default False)":
                "vllm/transformers_utils/configs/speculators/algos.py:36-38",
            **VLLM_TARGET_SOURCES,
        }, targets=VLLM_TARGETS),
    Engine(
        "safeailab-eagle", SAFEAILAB, ("",),
        taps_sorted_unique=False, fixed={"fc_norm": False, "norm_output": False, "norm_before_fc": False},
        notes=(("EaModel loads pytorch_model.bin, else model.safetensors, with strict=False; the v1 "
                "branch loads strictly and needs embed_tokens.weight (written), pytorch_model.bin and a "
                "fixed RoPE base (not targeted)"),
               "fc has a bias unless config 'bias' is false; layer 0 has no input_layernorm"),
        sources={
            "loading": "eagle/model/ea_model.py:48-76,120-136",
            "fc bias / layer 0 without input_layernorm": "eagle/model/cnets1.py:392-401,524",
            "no fc_norm / norm_output (EAGLE 3.1) in the EAGLE-1/2 draft": "eagle/model/cnets1.py:380-420",
        }),
]}

# which engines read each export layout (the exporter satisfies all of them at once)
LAYOUT_ENGINES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "sglang": ("sglang",),
    "speculators": ("speculators", "vllm-speculators"),
    "eagle1": ("safeailab-eagle",),
}


def refusing_engines(layout: str, architectures) -> list[tuple[Engine, str]]:
    """(engine, target class) for each engine reading ``layout`` that cannot serve a head on a target of one
    of ``architectures`` (the target config's ``architectures``; empty: nothing to check)."""
    return [(e, a) for e in (ENGINES[n] for n in LAYOUT_ENGINES[layout]) if e.targets
            for a in architectures or () if a not in e.targets]


# ---- dotted config paths ---------------------------------------------------------------------------
def get_path(config: dict, path: str):
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_path(config: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


# ---- what an engine makes of a config (the tests' model of each loader) ------------------------------
def read_taps(config: dict, engine: Engine) -> list[int] | None:
    """The tap ids ``engine`` reads, converted to eaglekit's meaning (layer inputs); None if absent."""
    for path in engine.tap_ids_at:
        ids = get_path(config, path)
        if ids:
            return [int(i) - engine.tap_offset for i in ids]
    return None


def read_tap_count(config: dict, engine: Engine) -> int:
    """How many taps the engine sizes ``fc`` for."""
    for path in engine.tap_count_at:
        value = get_path(config, path)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if value:
            return len(value)
    return engine.default_tap_count


def read_flag(config: dict, engine: Engine, flag: str):
    """The value of a head flag as the engine runs it."""
    if flag in engine.fixed:
        return engine.fixed[flag]
    value = get_path(config, flag)
    return engine.flags.get(flag) if value is None else value


def captured_layers(taps: list[int], engine: Engine) -> list[int]:
    """The layers whose inputs the engine concatenates into fc, in order."""
    return sorted(set(taps)) if engine.taps_sorted_unique else list(taps)
