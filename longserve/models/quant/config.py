"""The quantized formats' configs, read from config.json's `quantization_config` (or forced by `--quantization`,
vLLM's spelling), checked before the model is built: an unknown method, or a method with an option longserve
does not implement, is refused with a message naming what is supported. Each format then decides per module,
by its checkpoint (HF) name, how that module's weights are stored: a *scheme* (plain data, in schemes.py), or
None for a module the checkpoint keeps unquantized (GPTQ's `dynamic` "-:" rules, compressed-tensors' `ignore`,
AWQ's `modules_to_not_convert`, FP8's `ignored_layers`). models/quant/bind.py turns schemes into methods.

    gptq                bits 4/8, group_size (-1: per channel), desc_act (g_idx), sym, dynamic, checkpoint_format
    awq                 GEMM packing, 4 bits, zero points, group 128 (any group dividing K)
    compressed-tensors  pack-quantized W4A16/W8A16 (groups, channels, asym zero points, actorder group);
                        float-quantized FP8 W8A8 (tensor, channel or block weights; dynamic per-token /
                        per-group or static per-tensor activations); int-quantized INT8 W8A8 (symmetric)
    fp8                 e4m3 weights with block scales (weight_scale_inv) and per-token-group activations, or
                        per-tensor scales; on a checkpoint without quantization_config: quantized per
                        channel while loading
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from longserve.config import QUANTIZATION_ALIASES, QUANTIZATIONS

# the schemes live in schemes.py; bind.py, fp8.py, int8.py and wna16.py import them from here
from longserve.models.quant.schemes import Fp8Scheme, Int8Scheme, IntScheme, Scheme

logger = logging.getLogger("longserve.models.quant")

ALIASES = QUANTIZATION_ALIASES  # vLLM's names for these formats' kernels select the same format here
SUPPORTED = QUANTIZATIONS
# `--quantization NAME --load-format dummy` on a config.json without quantization_config: these formats
FORMAT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}


def _get(qc: Any, key: str, default: Any = None) -> Any:
    value = qc.get(key, default) if isinstance(qc, Mapping) else getattr(qc, key, default)
    return default if value is None else value


def _refuse(fmt: str, what: str, supported: str) -> ValueError:
    return ValueError(f"quantization_config ({fmt}): {what} is not supported; supported: {supported}")


class QuantFormat:
    """A parsed quantization_config: `scheme(hf_name)` for one checkpoint module (None: unquantized)."""

    name: ClassVar[str]

    def scheme(self, hf_name: str) -> Scheme | None:
        raise NotImplementedError

    def expert_scheme(self, hf_name: str) -> Scheme | None:
        return self.scheme(hf_name)

    def check_model(self, hf_config: Any) -> None:
        """Start-up checks against the model (before any weight is read): no quantized lm_head."""
        if self.scheme("lm_head") is not None:
            raise ValueError(
                f"quantization_config ({self.name}) quantizes lm_head; longserve keeps the LM head and the "
                "embeddings unquantized (quantized lm_heads are not supported)"
            )


def _matches_any(name: str, substrings: list[str]) -> bool:
    return any(s and s in name for s in substrings)


class GPTQFormat(QuantFormat):
    """GPTQ as AutoGPTQ / GPTQModel / optimum write it."""

    name = "gptq"
    FORMATS = ("gptq", "gptq_v2")

    def __init__(self, qc: Any) -> None:
        self.base = self._scheme(qc, _get(qc, "checkpoint_format", None) or _get(qc, "format", "gptq"))
        if _get(qc, "lm_head", False):
            raise _refuse("gptq", "lm_head: true (a quantized LM head)", "lm_head: false")
        dynamic = _get(qc, "dynamic", {}) or {}
        if not isinstance(dynamic, Mapping):
            raise _refuse("gptq", f"dynamic {dynamic!r}", "a mapping of module regexes to overrides")
        self.dynamic: list[tuple[bool, re.Pattern, dict]] = []
        for pattern, override in dynamic.items():
            negative = pattern.startswith("-:")
            try:
                regex = re.compile(pattern.removeprefix("-:").removeprefix("+:"))
            except re.error as e:
                raise ValueError(
                    f"quantization_config (gptq): dynamic rule {pattern!r} is not a regex: {e}"
                ) from None
            override = dict(override or {})
            if not negative:  # an override must itself be a supported scheme: checked now
                self._scheme({**_scheme_keys(qc), **override}, self.base.checkpoint)
            self.dynamic.append((negative, regex, override))
        in_block = _get(qc, "modules_in_block_to_quantize", None)
        # optimum: [[names quantized together], ...] or [names]: only those modules (substrings) are quantized
        self.only = (
            [n for group in in_block for n in (group if isinstance(group, list) else [group])]
            if in_block
            else None
        )
        self.qc = qc

    @staticmethod
    def _scheme(qc: Any, checkpoint: str) -> IntScheme:
        bits = int(_get(qc, "bits", 0))
        if bits not in (4, 8):
            raise _refuse("gptq", f"bits {bits}", "4, 8")
        group = int(_get(qc, "group_size", -1))
        if group != -1 and (group < 16 or group % 16):
            raise _refuse(
                "gptq", f"group_size {group}", "-1 (per channel), or a multiple of 16 (32, 64, 128, ...)"
            )
        checkpoint = str(checkpoint).lower()
        if checkpoint not in GPTQFormat.FORMATS:
            raise _refuse("gptq", f"checkpoint_format {checkpoint!r}", ", ".join(GPTQFormat.FORMATS))
        return IntScheme(
            bits=bits,
            group_size=group,
            sym=bool(_get(qc, "sym", True)),
            act_order=bool(_get(qc, "desc_act", False)),
            checkpoint=checkpoint,
        )

    def scheme(self, hf_name: str) -> Scheme | None:
        if hf_name == "lm_head" or hf_name.endswith(".lm_head"):
            return None  # lm_head: true was refused; dynamic rules naming lm_head change nothing
        for negative, regex, override in self.dynamic:  # the first matching rule decides (vLLM's order)
            if regex.match(hf_name):
                if negative:
                    return None
                return self._scheme({**_scheme_keys(self.qc), **override}, self.base.checkpoint)
        if self.only is not None and not _matches_any(hf_name, self.only):
            return None
        return self.base


def _scheme_keys(qc: Any) -> dict[str, Any]:
    return {k: _get(qc, k) for k in ("bits", "group_size", "sym", "desc_act") if _get(qc, k) is not None}


class AWQFormat(QuantFormat):
    """AWQ as AutoAWQ writes it (GEMM: qweight [K, N/8] in AWQ's interleaved order, qzeros, fp16 scales)."""

    name = "awq"

    def __init__(self, qc: Any) -> None:
        bits = int(_get(qc, "bits", _get(qc, "w_bit", 4)))
        if bits != 4:
            raise _refuse("awq", f"bits {bits}", "4")
        group = int(_get(qc, "group_size", _get(qc, "q_group_size", 128)))
        if group < 16 or group % 16:
            raise _refuse("awq", f"group_size {group}", "a multiple of 16 (128 as AutoAWQ writes)")
        version = str(_get(qc, "version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("awq", f"version {version!r} (packing)", "gemm")
        if not _get(qc, "zero_point", True):
            raise _refuse("awq", "zero_point: false", "zero_point: true")
        self.base = IntScheme(bits=4, group_size=group, sym=False, act_order=False, checkpoint="awq")
        self.skip = list(_get(qc, "modules_to_not_convert", []) or [])

    def scheme(self, hf_name: str) -> Scheme | None:
        if hf_name.endswith("lm_head") or _matches_any(hf_name, self.skip):
            return None
        return self.base


class Fp8Format(QuantFormat):
    """`quant_method: fp8`: the official Qwen3 / DeepSeek FP8 checkpoints (block 128x128 weight_scale_inv,
    dynamic activations), per-tensor FP8 checkpoints (weight_scale, input_scale when static), and a float
    checkpoint quantized per channel while loading (`--quantization fp8`: is_checkpoint_fp8_serialized
    false)."""

    name = "fp8"

    def __init__(self, qc: Any) -> None:
        fmt = str(_get(qc, "fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise _refuse("fp8", f"fmt {fmt!r}", "e4m3")
        if _get(qc, "scale_fmt", None) not in (None, "float", "float32"):
            raise _refuse("fp8", f"scale_fmt {_get(qc, 'scale_fmt')!r}", "float32 scales (the default)")
        activation = str(_get(qc, "activation_scheme", "dynamic")).lower()
        if activation not in ("dynamic", "static"):
            raise _refuse("fp8", f"activation_scheme {activation!r}", "dynamic, static")
        block = _get(qc, "weight_block_size", None)
        serialized = bool(_get(qc, "is_checkpoint_fp8_serialized", True))
        if not serialized:
            self.base = Fp8Scheme(weight="channel", activation="dynamic", checkpoint="online")
        elif block is not None:
            if len(block) != 2 or any(int(b) < 16 or int(b) % 16 for b in block):
                raise _refuse(
                    "fp8", f"weight_block_size {block}", "[n, k], multiples of 16 (e.g. [128, 128])"
                )
            if activation != "dynamic":
                raise _refuse("fp8", "static activations with block scales", "activation_scheme dynamic")
            self.base = Fp8Scheme("block", "dynamic", "fp8", (int(block[0]), int(block[1])))
        else:
            self.base = Fp8Scheme(weight="tensor", activation=activation, checkpoint="fp8")
        self.skip = list(_get(qc, "ignored_layers", None) or _get(qc, "modules_to_not_convert", None) or [])

    def scheme(self, hf_name: str) -> Scheme | None:
        if hf_name.endswith("lm_head") or _matches_any(hf_name, self.skip):
            return None
        return self.base


class CompressedTensorsFormat(QuantFormat):
    """compressed-tensors as llm-compressor writes it: config_groups of targets and schemes, an ignore
    list, a compression format (per group or for all)."""

    name = "compressed-tensors"

    def __init__(self, qc: Any) -> None:
        status = _get(qc, "quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise _refuse(self.name, f"quantization_status {status!r}", "compressed")
        for key, what in (("sparsity_config", "sparsity"), ("kv_cache_scheme", "a quantized KV cache scheme"),
                          ("transform_config", "transforms")):  # fmt: skip
            if _get(qc, key):
                raise _refuse(self.name, f"{what} ({key})", "weight and activation quantization only")
        fmt = _get(qc, "format", None)
        groups = _get(qc, "config_groups", {}) or {}
        if not groups:
            raise ValueError("quantization_config (compressed-tensors) has no config_groups: nothing to load")
        self.groups: list[tuple[list[str], Scheme]] = []
        for name, group in groups.items():
            targets = list(_get(group, "targets", []) or [])
            self.groups.append((targets, self._scheme(name, group, _get(group, "format", None) or fmt)))
        self.ignore = list(_get(qc, "ignore", []) or [])

    def _scheme(self, group_name: str, group: Any, fmt: str | None) -> Scheme:
        w, a = _get(group, "weights", None), _get(group, "input_activations", None)
        if _get(group, "output_activations", None):
            raise _refuse(self.name, f"output activation quantization (group {group_name})", "none")
        if w is None:
            raise _refuse(self.name, f"group {group_name} without weights", "weight quantization")
        wtype, bits, strategy = (
            _get(w, "type", "int"),
            int(_get(w, "num_bits", 8)),
            _get(w, "strategy", "tensor"),
        )
        sym = bool(_get(w, "symmetric", True))
        if _get(w, "dynamic", False):
            raise _refuse(self.name, "dynamic weights", "static weights")
        supported = ("pack-quantized W4A16/W8A16 (int weights, no activation quantization); float-quantized "
                     "FP8 W8A8; int-quantized INT8 W8A8")  # fmt: skip
        if wtype == "int" and a is None:
            if fmt != "pack-quantized" or bits not in (4, 8) or strategy not in ("group", "channel"):
                raise _refuse(self.name, f"int{bits} weights ({strategy}, format {fmt})", supported)
            actorder = _get(w, "actorder", None)
            if actorder not in (None, "group", "weight", "static", "dynamic"):
                raise _refuse(self.name, f"actorder {actorder!r}", "null, group, weight")
            group = int(_get(w, "group_size", 0)) if strategy == "group" else -1
            if strategy == "group" and (group < 16 or group % 16):
                raise _refuse(self.name, f"group_size {group}", "a multiple of 16")
            return IntScheme(bits, group, sym, act_order=actorder == "group", checkpoint="ct")
        if a is None or _get(a, "num_bits", 8) != 8 or bits != 8:
            raise _refuse(self.name, f"{wtype}{bits} weights with these activations", supported)
        atype, astrategy = _get(a, "type", "int"), _get(a, "strategy", "token")
        dynamic = bool(_get(a, "dynamic", False))
        if not _get(a, "symmetric", True) or not sym:
            raise _refuse(self.name, "asymmetric W8A8 weights or activations", "symmetric")
        if wtype == "float" and atype == "float" and fmt in ("float-quantized", "naive-quantized", None):
            if strategy == "block":
                block = _get(w, "block_structure", None) or [128, 128]
                if not dynamic or astrategy != "group" or int(_get(a, "group_size", 0)) != int(block[1]):
                    raise _refuse(self.name, "block FP8 weights without per-group dynamic activations",
                                  "input_activations dynamic, strategy group, group_size = the block's k")  # fmt: skip
                return Fp8Scheme("block", "dynamic", "ct", (int(block[0]), int(block[1])))
            if strategy not in ("tensor", "channel"):
                raise _refuse(self.name, f"FP8 weight strategy {strategy!r}", "tensor, channel, block")
            return Fp8Scheme(strategy, self._activation(dynamic, astrategy), "ct")
        if wtype == "int" and atype == "int" and fmt in ("int-quantized", "naive-quantized", None):
            if strategy not in ("tensor", "channel"):
                raise _refuse(self.name, f"INT8 weight strategy {strategy!r}", "tensor, channel")
            return Int8Scheme(strategy, self._activation(dynamic, astrategy))
        raise _refuse(self.name, f"{wtype} weights with {atype} activations (format {fmt})", supported)

    def _activation(self, dynamic: bool, strategy: str) -> str:
        if dynamic and strategy == "token":
            return "dynamic"
        if not dynamic and strategy == "tensor":
            return "static"
        raise _refuse(self.name, f"{'dynamic' if dynamic else 'static'} {strategy} activations",
                      "dynamic per token, static per tensor")  # fmt: skip

    @staticmethod
    def _match(name: str, target: str) -> bool:
        if target.startswith("re:"):
            return re.match(target[3:], name) is not None
        return target == "Linear" or name == target or name.endswith("." + target)

    def scheme(self, hf_name: str) -> Scheme | None:
        if any(self._match(hf_name, t) and t != "Linear" for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(self._match(hf_name, t) for t in targets):
                return scheme
        return None


FORMATS: dict[str, type[QuantFormat]] = {
    "gptq": GPTQFormat,
    "awq": AWQFormat,
    "fp8": Fp8Format,
    "compressed-tensors": CompressedTensorsFormat,
}


def normalize_quantization(name: str) -> str:
    """vLLM's spelling of a format -> longserve's name; ValueError naming the supported ones."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ValueError(
            f"quantization {name!r} is not supported; supported: {', '.join(SUPPORTED)} (vLLM's gptq_marlin "
            "and awq_marlin mean gptq and awq)"
        )
    return key


def parse_quant_format(hf_config: Any) -> QuantFormat | None:
    """The checkpoint's format from config.json's quantization_config (None: unquantized), checked in full:
    unknown methods and unsupported options raise ValueError naming what is supported."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = _get(qc, "quant_method", None)
    if not method:
        raise ValueError(
            "config.json has a quantization_config without a quant_method: cannot tell its format"
        )
    method = str(getattr(method, "value", method))
    fmt = FORMATS[normalize_quantization(method)](qc)
    fmt.check_model(hf_config)
    return fmt


def apply_quantization(hf_config: Any, quantization: str | None, load_format: str = "auto") -> Any:
    """Reconcile `--quantization` with config.json (in place; returns hf_config), before anything is read:
    unset: the checkpoint's own format; set: it must agree with the checkpoint's quantization_config, except
    that `fp8` on a float checkpoint quantizes it while loading (vLLM's online FP8), and that with
    load_format='dummy' a config without one takes the format's defaults (random weights in that format).
    Then the format is parsed in full (parse_quant_format), so that a bad one fails here."""
    declared = getattr(hf_config, "quantization_config", None) or None
    if quantization:
        wanted = normalize_quantization(quantization)
        if declared:
            method = str(_get(declared, "quant_method", ""))
            if normalize_quantization(method or "?") != wanted:
                raise ValueError(
                    f"--quantization {quantization} disagrees with config.json's quantization_config "
                    f"(quant_method {method!r}); omit the flag to use the checkpoint's format"
                )
        elif wanted == "fp8":
            hf_config.quantization_config = {
                "quant_method": "fp8", "activation_scheme": "dynamic", "is_checkpoint_fp8_serialized": False,
            }  # fmt: skip
            logger.info("quantizing the float checkpoint to FP8 (e4m3, per channel) while loading")
        elif load_format == "dummy" and wanted in FORMAT_DEFAULTS:
            hf_config.quantization_config = dict(FORMAT_DEFAULTS[wanted])
            logger.info("dummy weights in %s format: %s", wanted, hf_config.quantization_config)
        else:
            raise ValueError(
                f"--quantization {quantization}: config.json has no quantization_config, i.e. the checkpoint "
                f"holds float weights; only fp8 quantizes a float checkpoint while loading ({quantization} "
                "needs a checkpoint quantized in that format, or --load-format dummy for random weights)"
            )
    parse_quant_format(hf_config)
    return hf_config
