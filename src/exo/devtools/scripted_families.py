"""The model families scripted test models come in (see scripted_models.py): each one's
tiny architecture config, special tokens and a test chat template modelled on the real
one, and per family a script of thinking plus a get_weather tool call with what exo's
output parser makes of it."""

from dataclasses import dataclass, field
from typing import Any

from exo.devtools.tiny_configs import TINY_CONFIGS

GET_WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}
SAMPLE_MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
# SAMPLE_MESSAGES answered by a get_weather call and its result.
SAMPLE_TOOL_RESULT_MESSAGES: list[dict[str, Any]] = [
    *SAMPLE_MESSAGES,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"weather": "sunny"}'},
]


# Chat templates: the families' real ones cut down to what exo passes them (system, user,
# assistant with reasoning_content and tool_calls, tool results, `tools`,
# `enable_thinking`), each ending in the family's own generation prompt.

QWEN3_TEMPLATE = r"""
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if message.reasoning_content -%}{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}{%- endif -%}
{{- message.content or '' -}}
{%- for tool_call in message.tool_calls or [] -%}
{%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}
{%- elif messages[-1].role == 'tool' -%}{{- '<|after_tool|>' -}}
{%- endif -%}
{%- endif -%}
"""

GLM47_TEMPLATE = r"""
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- '<|system|>' + m.content -}}
{%- elif m.role == 'user' -%}{{- '<|user|>' + m.content -}}
{%- elif m.role == 'assistant' -%}
{{- '<|assistant|>' -}}
{%- if m.reasoning_content -%}{{- '<think>' + m.reasoning_content.strip() + '</think>' -}}{%- else -%}{{- '</think>' -}}{%- endif -%}
{{- (m.content or '').strip() -}}
{%- for tc in m.tool_calls or [] -%}
{%- if tc.function -%}{%- set tc = tc.function -%}{%- endif -%}
{{- '<tool_call>' + tc.name -}}
{%- if tc.arguments is mapping -%}
{%- for k, v in tc.arguments.items() -%}
{{- '<arg_key>' + k + '</arg_key><arg_value>' + (v if v is string else v | tojson) + '</arg_value>' -}}
{%- endfor -%}
{%- else -%}{{- tc.arguments -}}{%- endif -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{{- '<|observation|><tool_response>' + m.content + '</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>' + ('</think>' if (enable_thinking is defined and not enable_thinking) else '<think>') -}}
{%- endif -%}
"""

MINIMAX_M2_TEMPLATE = r"""
{%- set system = messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' -%}
{{- ']~!b[]~b]system\n' + system -}}
{%- if tools -%}
{{- '\n\n# Tools\nYou may call one or more tools to assist with the user query.\nHere are the tools available in JSONSchema format:\n\n<tools>\n' -}}
{%- for tool in tools -%}{{- '<tool>' + (tool | tojson) + '</tool>\n' -}}{%- endfor -%}
{{- '</tools>\n\nWhen making tool calls, use XML format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- ']~b]user\n' + m.content + '[e~[\n' -}}
{%- elif m.role == 'assistant' -%}
{{- ']~b]ai\n' -}}
{%- if m.reasoning_content -%}{{- '<think>\n' + m.reasoning_content.strip() + '\n</think>\n\n' -}}{%- endif -%}
{{- m.content or '' -}}
{%- if m.tool_calls -%}
{{- '\n<minimax:tool_call>\n' -}}
{%- for tc in m.tool_calls -%}
{%- if tc.function -%}{%- set tc = tc.function -%}{%- endif -%}
{{- '<invoke name="' + tc.name + '">\n' -}}
{%- if tc.arguments is mapping -%}
{%- for k, v in tc.arguments.items() -%}
{{- '<parameter name="' + k + '">' + (v if v is string else v | tojson) + '</parameter>\n' -}}
{%- endfor -%}
{%- else -%}{{- tc.arguments + '\n' -}}{%- endif -%}
{{- '</invoke>\n' -}}
{%- endfor -%}
{{- '</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- elif m.role == 'tool' -%}{{- ']~b]tool\n<response>' + m.content + '</response>[e~[\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\n<think>\n' -}}{%- endif -%}
"""

KIMI_K2_TEMPLATE = r"""
{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}{%- endif -%}
{%- if messages[0].role != 'system' -%}
{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- '<|im_system|>system<|im_middle|>' + m.content + '<|im_end|>' -}}
{%- elif m.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' + m.content + '<|im_end|>' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|im_assistant|>assistant<|im_middle|><think>' + (m.reasoning_content or '') + '</think>' + (m.content or '') -}}
{%- if m.tool_calls -%}
{{- '<|tool_calls_section_begin|>' -}}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function else tc -%}
{{- '<|tool_call_begin|>' + (tc.id or 'functions.' + f.name + ':' + loop.index0 | string) + '<|tool_call_argument_begin|>' -}}
{{- f.arguments if f.arguments is string else f.arguments | tojson -}}
{{- '<|tool_call_end|>' -}}
{%- endfor -%}
{{- '<|tool_calls_section_end|>' -}}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_system|>tool<|im_middle|>## Return of ' + (m.tool_call_id or '') + '\n' + m.content + '<|im_end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}
"""

GEMMA4_TEMPLATE = r"""
{%- macro value(v) -%}{%- if v is string -%}{{- '<|"|>' + v + '<|"|>' -}}{%- else -%}{{- v | tojson -}}{%- endif -%}{%- endmacro -%}
{{- bos_token -}}
{%- set has_system = messages[0].role == 'system' -%}
{%- if has_system or tools or enable_thinking -%}
{{- '<|turn>system\n' -}}
{%- if enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}
{%- if has_system -%}{{- messages[0].content -}}{%- endif -%}
{%- for tool in tools or [] -%}
{%- set f = tool.function if tool.function else tool -%}
{{- '<|tool>declaration:' + f.name + (f | tojson) + '<tool|>' -}}
{%- endfor -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<|turn>user\n' + m.content + '<turn|>\n' -}}
{%- elif m.role == 'assistant' -%}
{{- '<|turn>model\n' + (m.content or '') -}}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function if tc.function else tc -%}
{{- '<|tool_call>call:' + f.name + '{' -}}
{%- if f.arguments is mapping -%}
{%- for k, v in f.arguments.items() -%}{{- k + ':' + value(v) -}}{%- if not loop.last -%},{%- endif -%}{%- endfor -%}
{%- endif -%}
{{- '}<tool_call|>' -}}
{%- endfor -%}
{%- if not m.tool_calls -%}{{- '<turn|>\n' -}}{%- endif -%}
{%- elif m.role == 'tool' -%}
{{- '<|tool_response>response:' + (m.name or 'tool') + '{value:' + value(m.content) + '}<tool_response|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}
"""

# Harmony as gpt-oss's template writes it, with the tools' parameters as JSON schema
# rather than the template's TypeScript rendering of them.
HARMONY_TEMPLATE = r"""
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: ' + (reasoning_effort or 'medium') + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- set has_system = messages[0].role in ('system', 'developer') -%}
{%- if has_system or tools -%}
{{- '<|start|>developer<|message|>' -}}
{%- if has_system -%}{{- '# Instructions\n\n' + messages[0].content -}}{%- endif -%}
{%- if tools -%}
{{- '\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for tool in tools -%}
{%- set f = tool.function if tool.function else tool -%}
{{- '// ' + (f.description or '') + '\ntype ' + f.name + ' = (_: ' + (f.parameters | tojson) + ') => any;\n\n' -}}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}
{%- elif m.role == 'assistant' -%}
{%- if m.reasoning_content -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' -}}{%- endif -%}
{%- if m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function else tc -%}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + f.name + ' <|constrain|>json<|message|>' -}}
{{- (f.arguments if f.arguments is string else f.arguments | tojson) + '<|call|>' -}}
{%- endfor -%}
{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + (m.content or '') + '<|end|>' -}}
{%- endif -%}
{%- elif m.role == 'tool' -%}
{{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
"""

# DeepSeek-R1-Distill-Llama's template, cut down: a `llama` model whose generation prompt
# opens the thinking block. Nothing in the family table says it thinks; only its
# tokenizer's `<think>` tokens do.
R1_DISTILL_TEMPLATE = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{{- '<｜User｜>' + message.content -}}
{%- elif message.role == 'assistant' -%}{{- '<｜Assistant｜>' + (message.content or '') + '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\n' -}}{%- endif -%}
"""


@dataclass(frozen=True)
class Family:
    """What a scripted model of one family needs: the architecture's config, the
    tokenizer's special tokens and its chat template (None where exo encodes prompts in
    Python: DeepSeek V3.2 and V4)."""

    config: dict[str, Any]
    model_type: str
    chat_template: str | None
    bos: str | None
    # The token a scripted output ends with, and every end-of-generation token.
    eos: str
    stop_tokens: tuple[str, ...]
    # Special tokens that frame turns and never show in an answer.
    control_tokens: tuple[str, ...]
    # Added tokens an answer may contain: think and tool-call markers.
    marker_tokens: tuple[str, ...] = ()
    # A control token the test template ends the generation prompt with when the last
    # message is a tool result (one of control_tokens), where a second script starts.
    tool_result_prompt_end: str | None = None


_DEEPSEEK_CONTROL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")

FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        config=TINY_CONFIGS["qwen3"],
        model_type="qwen3",
        chat_template=QWEN3_TEMPLATE,
        bos=None,
        eos="<|im_end|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        control_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|after_tool|>"),
        marker_tokens=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        tool_result_prompt_end="<|after_tool|>",
    ),
    "glm4_moe": Family(
        config=TINY_CONFIGS["glm4_moe"],
        model_type="glm4_moe",
        chat_template=GLM47_TEMPLATE,
        bos=None,
        eos="<|observation|>",
        stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
        control_tokens=(
            "<|endoftext|>",
            "[gMASK]",
            "<sop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
        ),
        marker_tokens=(
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "<tool_response>",
            "</tool_response>",
        ),
    ),
    "minimax": Family(
        config=TINY_CONFIGS["minimax"],
        model_type="minimax_m2",
        chat_template=MINIMAX_M2_TEMPLATE,
        bos="]~!b[",
        eos="[e~[",
        stop_tokens=("[e~[",),
        control_tokens=("]~!b[", "]~b]", "[e~["),
        marker_tokens=("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
    ),
    "kimi_k2": Family(
        # Without YaRN: transformers has no kimi_k2 config class (Kimi ships its own as remote
        # code), and its fallback config, which AutoTokenizer reads, cannot take rope_scaling.
        # Rope does not matter here anyway: attention adds nothing to a scripted model.
        config={key: value for key, value in TINY_CONFIGS["kimi_k25"]["text_config"].items() if key != "rope_scaling"},
        model_type="kimi_k2",
        chat_template=KIMI_K2_TEMPLATE,
        bos="[BOS]",
        eos="<|im_end|>",
        stop_tokens=("<|im_end|>", "[EOS]"),
        control_tokens=(
            "[BOS]",
            "[EOS]",
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
        ),
        marker_tokens=(
            "<think>",
            "</think>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
    ),
    "gemma4": Family(
        config=TINY_CONFIGS["gemma4"],
        model_type="gemma4",
        chat_template=GEMMA4_TEMPLATE,
        bos="<bos>",
        eos="<|tool_response>",
        stop_tokens=("<eos>", "<turn|>", "<|tool_response>"),
        control_tokens=("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|tool>", "<tool|>"),
        marker_tokens=("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", '<|"|>'),
    ),
    "gpt_oss": Family(
        config=TINY_CONFIGS["gpt_oss"],
        model_type="gpt_oss",
        chat_template=HARMONY_TEMPLATE,
        bos="<|startoftext|>",
        eos="<|call|>",
        stop_tokens=("<|return|>", "<|call|>", "<|endoftext|>"),
        control_tokens=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|call|>"),
        # Harmony's headers are text to the parser, so they show in the decoded output.
        marker_tokens=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"),
    ),
    "r1_distill_llama": Family(
        config=TINY_CONFIGS["llama"],
        model_type="llama",
        chat_template=R1_DISTILL_TEMPLATE,
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        stop_tokens=("<｜end▁of▁sentence｜>",),
        control_tokens=_DEEPSEEK_CONTROL,
        marker_tokens=("<think>", "</think>"),
    ),
    "deepseek_v32": Family(
        config=TINY_CONFIGS["deepseek_v32"],
        model_type="deepseek_v32",
        chat_template=None,
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        stop_tokens=("<｜end▁of▁sentence｜>",),
        control_tokens=_DEEPSEEK_CONTROL,
        marker_tokens=("<think>", "</think>"),
    ),
    "deepseek_v4": Family(
        config=TINY_CONFIGS["deepseek_v4"],
        model_type="deepseek_v4",
        chat_template=None,
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
        stop_tokens=("<｜end▁of▁sentence｜>",),
        control_tokens=_DEEPSEEK_CONTROL,
        marker_tokens=("<think>", "</think>"),
    ),
}


@dataclass(frozen=True)
class ScriptedOutput:
    """A script and what exo's output parser makes of it (reasoning and content exactly as
    the parser returns them, whitespace included)."""

    script: tuple[str, ...]
    reasoning: str
    content: str
    # (name, arguments) of each tool call, in order.
    tool_calls: tuple[tuple[str, dict[str, Any]], ...] = field(default_factory=tuple)

    @property
    def text(self) -> str:
        return "".join(self.script)


_DSML = "｜DSML｜"

# For each family: thinking, a little content and one get_weather call, with some markers
# split across tokens. Written for a request with SAMPLE_MESSAGES (or any other messages)
# and tools=[GET_WEATHER_TOOL]; the expected parts are what exo's output parser returns,
# so API tests can compare their responses with them.
FAMILY_SCRIPTS: dict[str, ScriptedOutput] = {
    "qwen3": ScriptedOutput(
        script=(
            "<think>",
            "\nThe user",
            " wants the weather in Paris.",
            "\n</th",
            "ink>",
            "\n\nLet me check.",
            "\n<tool_",
            "call>",
            '\n{"name": "get_weather", ',
            '"arguments": {"city": "Paris"}}',
            "\n</tool_call>",
        ),
        reasoning="\nThe user wants the weather in Paris.\n",
        content="\n\nLet me check.\n",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
    "glm4_moe": ScriptedOutput(
        script=(
            "The user",
            " wants the weather in Paris.",
            "</think>",
            "Let me check.",
            "<tool_",
            "call>",
            "get_weather",
            "<arg_key>",
            "city",
            "</arg_key>",
            "<arg_value>",
            "Paris",
            "</arg_value>",
            "</tool_call>",
        ),
        reasoning="The user wants the weather in Paris.",
        content="Let me check.",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
    "minimax": ScriptedOutput(
        script=(
            "The user",
            " wants the weather in Paris.",
            "\n</think>",
            "\n\nLet me check.",
            "\n<minimax:",
            "tool_call>",
            '\n<invoke name="get_weather">',
            '\n<parameter name="city">Paris</parameter>',
            "\n</invoke>",
            "\n</minimax:tool_call>",
        ),
        reasoning="The user wants the weather in Paris.\n",
        content="\n\nLet me check.\n",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
    "kimi_k2": ScriptedOutput(
        script=(
            "<think>",
            "The user",
            " wants the weather in Paris.",
            "</think>",
            "Let me check.",
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "functions.get_weather:0",
            "<|tool_call_argument_begin|>",
            '{"city": "Paris"}',
            "<|tool_call_end|>",
            "<|tool_calls_section_",
            "end|>",
        ),
        reasoning="The user wants the weather in Paris.",
        content="Let me check.",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
    "gemma4": ScriptedOutput(
        script=(
            "<|channel>",
            "thought\n",
            "The user wants",
            " the weather in Paris.",
            "<chan",
            "nel|>",
            "Let me check.",
            "<|tool_call>",
            "call:get_weather",
            '{city:<|"|>',
            "Paris",
            '<|"|>}',
            "<tool_call|>",
        ),
        reasoning="The user wants the weather in Paris.",
        content="Let me check.",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
    "gpt_oss": ScriptedOutput(
        script=(
            "<|channel|>",
            "analysis",
            "<|message|>",
            "The user",
            " wants the weather in Paris.",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|chan",
            "nel|>commentary",
            " to=functions.get_weather ",
            "<|constrain|>",
            "json",
            "<|mess",
            "age|>",
            '{"city":',
            '"Paris"}',
        ),
        reasoning="The user wants the weather in Paris.",
        content="",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
    "deepseek_v32": ScriptedOutput(
        script=(
            "The user",
            " wants the weather in Paris.",
            "</think>",
            "Let me check.",
            f"\n\n<{_DSML}function",
            "_calls>\n",
            f'<{_DSML}invoke name="get_weather">\n',
            f'<{_DSML}parameter name="city" string="true">',
            "Paris",
            f"</{_DSML}parameter>\n",
            f"</{_DSML}invoke>\n",
            f"</{_DSML}function_calls>",
        ),
        reasoning="The user wants the weather in Paris.",
        content="Let me check.",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
    "deepseek_v4": ScriptedOutput(
        script=(
            "The user",
            " wants the weather in Paris.",
            "</th",
            "ink>",
            "Let me check.",
            "\n\n<",
            f"{_DSML}tool",
            "_calls>\n",
            f'<{_DSML}invoke name="get_weather">\n',
            f'<{_DSML}parameter name="city" string="true">',
            "Paris",
            f"</{_DSML}parameter>\n",
            f"</{_DSML}invoke>\n",
            f"</{_DSML}tool_calls>",
        ),
        reasoning="The user wants the weather in Paris.",
        content="Let me check.",
        tool_calls=(("get_weather", {"city": "Paris"}),),
    ),
}


# For families with a tool_result_prompt_end: the answer once get_weather's result is in.
# No piece repeats one of FAMILY_SCRIPTS[family]'s, so one model can hold both scripts.
AFTER_TOOL_RESULT_SCRIPTS: dict[str, ScriptedOutput] = {
    "qwen3": ScriptedOutput(
        script=("<thi", "nk>The tool", " says it is sunny.", "</think>", "It is sunny", " in Paris."),
        reasoning="The tool says it is sunny.",
        content="It is sunny in Paris.",
    ),
}

# Text alone, for families whose generation prompt does not open a thinking block
# (Qwen3, Kimi K2, Gemma 4): no reasoning, no tool call.
PLAIN_SCRIPT = ScriptedOutput(script=("Hello", " from", " exo."), reasoning="", content="Hello from exo.")
