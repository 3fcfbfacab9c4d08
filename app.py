"""UNI MAX chat app: python app.py [--preset FILE] [--model PATH_OR_ID] [--mode M] [--host H]
[--port P] [--api-only] [--api-key KEY] [--allowed-hosts NAMES] [--cors-origins ORIGINS].
Loads the model once, then serves the Gradio page and the OpenAI-compatible API (/v1) from one
server and one engine thread, while it warms every mode up (compiles, captures the decode
graphs) in the background."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
from pathlib import Path

import torch

from ui.guard import DEFAULT_MAX_BODY, LOOPBACK, WILDCARDS, Access
from unimax.modes import MODES
from unimax.presets import Preset, PresetError, load_preset

MAX_UPLOAD = "1mb"  # the page takes no uploads of its own; Gradio's upload route is capped
DEFAULT_PRESET = Path(__file__).resolve().parent / "presets" / "demo.yaml"
KEY_VARIABLE = "UNIMAX_API_KEY"  # keys from the environment (comma-separated): not in `ps`


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default=str(DEFAULT_PRESET), help="preset YAML file")
    parser.add_argument("--model", help="override the preset's model (folder or hub id)")
    parser.add_argument("--mode", choices=MODES, help="override the preset's default mode")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--api-only", action="store_true",
                        help="serve the OpenAI-compatible API (/v1) without the page")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="capture graphs on first use instead of at start-up")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require this key: Authorization: Bearer KEY on /v1 and /metrics, "
                        f"and as the page's password (repeat for several keys, each with its "
                        f"own kept states; or set {KEY_VARIABLE}=KEY1,KEY2)")
    parser.add_argument("--allowed-hosts", default="", metavar="NAMES",
                        help="comma-separated Host names served besides the loopback names "
                        "and --host (* for any): the names people reach this machine by")
    parser.add_argument("--cors-origins", default="", metavar="ORIGINS",
                        help="comma-separated origins (https://app.example) whose pages may "
                        "call the API from a browser (* for any); others are refused")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY / 2**20,
                        help="largest API request body in MiB (default %(default)g)")
    return parser.parse_args(argv)


def split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def access_of(args) -> Access:
    """Who may use the server (ui/guard.py): from the command line and the environment."""
    keys = [*args.api_key, *split_list(os.environ.get(KEY_VARIABLE, ""))]
    return Access.make(args.host, split_list(args.allowed_hosts), split_list(args.cors_origins),
                       keys, max(1, int(args.max_body_mb * 2**20)))


def port_problem(host: str, port: int) -> str | None:
    """Why the page cannot be served on host:port (checked before the model loads), or None."""
    if not 1 <= port <= 65535:
        return f"--port {port} is outside 1..65535"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            # as uvicorn binds: a port whose last server's connections linger in TIME_WAIT
            # after a restart is free to serve on (Linux still refuses one that is listening)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        return (f"cannot serve on {host}:{port} ({err.strerror or err}): is another app using "
                "it? pick a free port with --port")
    return None


def step(text: str) -> float:
    print(f"[unimax] {text}", flush=True)
    return time.perf_counter()


def chosen_preset(args) -> Preset:
    """The preset file with the command line's --model and --mode on top."""
    preset = load_preset(args.preset)
    overrides = {k: v for k, v in (("model", args.model), ("mode", args.mode)) if v}
    if args.model and args.model != preset.model:  # its examples were for another model
        overrides["examples"] = ()
    return dataclasses.replace(preset, **overrides)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        preset = chosen_preset(args)
    except PresetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    problem = port_problem(args.host, args.port)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    access = access_of(args)
    if args.host not in LOOPBACK and not access.keys:
        print(f"[unimax] warning: serving on {args.host} without an API key: anyone who can "
              f"reach this machine can use the model and read the API's replies; set "
              f"--api-key or {KEY_VARIABLE}", file=sys.stderr, flush=True)
    if args.host in WILDCARDS and not args.allowed_hosts:
        # (the Host allow-list: a browser or client that names this machine by its address
        # or name on the network is refused with 400 until it is listed)
        print(f"[unimax] note: serving on every interface ({args.host or 'all'}), but only "
              "requests to localhost pass the Host check; list the names and addresses "
              "clients use with --allowed-hosts (e.g. --allowed-hosts 192.168.1.20,mybox), "
              "or '*' for any", file=sys.stderr, flush=True)
    if not torch.cuda.is_available():
        if preset.device not in ("auto", "cpu"):  # cuda or cuda:N, asked for and not here
            # (before, the app announced a CPU run here and the load then failed on the device)
            build = "" if torch.version.cuda else (
                "; this PyTorch is a CPU build: a CUDA build comes from "
                "https://pytorch.org/get-started/locally/")
            print(f"error: preset {preset.name} asks for device: {preset.device}, but no CUDA "
                  f"GPU is visible here{build}. Run it on a machine with an NVIDIA GPU, or "
                  "in a copy of the preset set device: cpu (slow for real models)",
                  file=sys.stderr)
            return 2
        print("[unimax] no CUDA GPU here: running on the CPU (FP8 is emulated, graphs are off; "
              "fine for a smoke run, slow for real models)", flush=True)
    import uvicorn

    from unimax.memory import MemoryPlanError
    from unimax.ops.choices import use_cache_folder
    from unimax.service import EngineService

    use_cache_folder()  # compile caches kept there; kernel choices remembered, else timed later

    start = step(f"loading {preset.model} (preset {preset.name})…")
    try:
        service = EngineService(preset)
    except MemoryPlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"error: could not load the model: {err}", file=sys.stderr)
        return 2
    cfg = service.model.config
    step(f"loaded {cfg.num_hidden_layers} GDN layers, hidden {cfg.hidden_size}, vocab "
         f"{cfg.vocab_size} on {service.device} in {time.perf_counter() - start:.1f} s")
    if service.memory_plan:
        step("GPU memory plan:\n" + service.memory_said())
    service.start()
    app = build_app(service, api_only=args.api_only, access=access)
    if not args.no_warm_up:
        what = "capturing CUDA graphs where there is a GPU"
        if preset.compile_step and service.device.type == "cuda":
            what = "compiling each mode's decode step and capturing its CUDA graphs: a minute " \
                   "or more per mode"
        step(f"warming up every mode, {preset.mode} first, while serving ({what}); a reply "
             "sent meanwhile waits for it, and each mode serves at full speed once ready")
        service.warm_up_in_background(on_done=warmed_up(service), on_ready=ready_bar(start))
    url = f"http://{args.host}:{args.port}"
    step(f"serving on {url}" + ("" if args.api_only else " (the page)") +
         f"; OpenAI API at {url}/v1")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def ready_bar(start: float):
    """on_ready for the warm-up: a line with a bar of the modes ready so far, as each is."""
    done = []

    def on_ready(mode: str, _seconds: float) -> None:
        done.append(mode)
        bar = "#" * len(done) + "-" * (len(MODES) - len(done))
        step(f"[{bar}] {mode} ready, {time.perf_counter() - start:.1f} s after start "
             f"({len(done)} of {len(MODES)} modes)")

    return on_ready


def warmed_up(service):
    """on_done for the warm-up: says how it ended, and the GPU memory it measured."""
    def on_done(seconds: float, error: str | None) -> None:
        if error:
            print(f"[unimax] warm-up failed ({error}); that mode compiles and captures on "
                  f"first use instead (warm-up ended after {seconds:.1f} s)", file=sys.stderr,
                  flush=True)
        else:
            step(f"warm-up done in {seconds:.1f} s: every mode ready")
        said = service.memory_said(after_warm_up=True)
        if said:
            step(said)

    return on_done


def build_app(service, api_only: bool = False, access: Access | None = None):
    """One server: the OpenAI API's routes, then (unless api_only) the Gradio page at /, all
    behind the guard of who may use it (ui/guard.py; loopback only by default)."""
    from fastapi import FastAPI

    from ui.guard import Guard
    from ui.openai_api import add_openai_api

    access = access or Access.make()
    app = FastAPI(title="UNI MAX")
    app.add_middleware(Guard, access=access)
    add_openai_api(app, service)
    if api_only:
        return app
    import gradio as gr

    from ui import build_demo
    from ui.page import CSS

    demo = build_demo(service, service.preset)
    demo.queue(default_concurrency_limit=None)
    # with keys, the page's login takes any name and one of the keys as the password
    auth = (lambda _user, password: access.key_of(f"Bearer {password}") is not None) \
        if access.keys else None
    return gr.mount_gradio_app(app, demo, path="/", css=CSS, show_error=True,
                               max_file_size=MAX_UPLOAD, auth=auth,
                               auth_message="This UNI MAX server needs its API key: any user "
                               "name, and the key as the password.")


if __name__ == "__main__":
    raise SystemExit(main())
