"""Loading and unloading LoRA adapters while serving: vLLM's `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`, with its bodies and plain-text success replies.

They let whoever can reach the server make it read any directory it can see, so they answer only when the server
was started with `--enable-runtime-lora-updating` (vLLM: the VLLM_ALLOW_RUNTIME_LORA_UPDATING environment
variable) and, like every /v1/ route, need the API key when one is set.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from jaxserve.lora_request import LoRARequest
from jaxserve.server.errors import APIError, bad_request, parse_json
from jaxserve.server.protocol import RequestModel
from jaxserve.server.request_bodies import parse_request
from jaxserve.server.serving import ServerState


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace the adapter already served under this name


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name alone picks the adapter here


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    if not state.runtime_lora_updating:
        raise APIError(404, "Loading LoRA adapters at runtime is off: start the server with "
                            "--enable-runtime-lora-updating to allow it", code="runtime_lora_updating_off")
    return state


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = _state(request)
    body = parse_request(LoadLoRAAdapterRequest, await parse_json(request))
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise bad_request("Both lora_name and lora_path must be non-empty", param="lora_name" if not name else "lora_path")
    if name in state.served_model_names:
        raise bad_request(f"'{name}' is the served model's name; give the adapter another name", param="lora_name")
    replace = name in state.lora_adapters
    if replace and not body.load_inplace:
        raise bad_request(f"The lora adapter '{name}' has already been loaded; unload it first, send "
                          '"load_inplace": true to replace it, or give the adapter another name', param="lora_name")
    try:
        lora = await state.engine.add_lora(LoRARequest(name, state.next_lora_id(), path), load_inplace=replace)
    except (ValueError, OSError) as exc:  # a directory it cannot serve: the loader's message names why
        raise bad_request(str(exc), param="lora_path") from None
    state.lora_adapters[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")  # vLLM's reply, replaced or not


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = _state(request)
    body = parse_request(UnloadLoRAAdapterRequest, await parse_json(request))
    if state.lora_adapters.pop(body.lora_name, None) is None:  # requests may no longer name it
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="lora_adapter_not_found")
    state.engine.remove_lora(body.lora_name)  # between steps; requests already queued with it finish
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
