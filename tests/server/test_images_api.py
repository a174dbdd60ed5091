"""Images over every API, through the real clients and a real server: OpenAI image_url parts
(data: URLs), Responses input_image parts, Anthropic image blocks, Ollama images; and the
refusals (remote URLs, bombs, corrupt data, too many images, images to a text-only model),
after which the server serves on."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from live_server import API_KEY, make_engine, serving
from tiny_models import noise_image, png_bomb

from astrai.inference import GenerationParams, GenerationRequest

QUESTION = "What is this?"
MAX_TOKENS = 8


def image_bytes(seed: int, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    noise_image(seed).save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def openai_content(*images: bytes) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in images]
    return [*parts, {"type": "text", "text": QUESTION}]


@pytest.fixture(scope="module")
def llava_server(llava_dir):
    engine = make_engine(
        llava_dir, max_images_per_request=2, max_image_pixels=200 * 200, max_image_bytes=1 << 20
    )
    with serving(engine) as server:
        yield server


@pytest.fixture(scope="module")
def clients(llava_server):
    import anthropic
    import openai

    return (
        openai.OpenAI(base_url=f"{llava_server.base_url}/v1", api_key=API_KEY, max_retries=0),
        anthropic.Anthropic(base_url=llava_server.base_url, api_key=API_KEY, max_retries=0),
    )


def engine_answer(engine, *seeds: int) -> str:
    """The engine's own greedy answer to the image(s) and the question (whose equality with
    transformers tests/inference/test_images.py proves)."""
    parts = [{"type": "image", "image": noise_image(seed)} for seed in seeds]
    request = GenerationRequest(
        [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
        GenerationParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    return engine.generate(request)


def openai_answer(client, content) -> str:
    reply = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    return reply.choices[0].message.content


@pytest.mark.parametrize("seeds", [(1,), (1, 2)], ids=["one image", "two images"])
def test_openai_image_url_parts(llava_server, clients, seeds):
    openai_client, _ = clients
    expected = engine_answer(llava_server.engine, *seeds)
    content = openai_content(*(image_bytes(seed) for seed in seeds))
    assert openai_answer(openai_client, content) == expected


@pytest.mark.parametrize(
    "checkpoint", ["smolvlm_dir", "qwen2_vl_dir", "llava_next_dir", "gemma3_vlm_dir"]
)
def test_openai_image_url_parts_to_models_that_lay_images_out_otherwise(request, checkpoint):
    """SmolVLM's images expand to tiles within their layout text, Qwen2-VL's to as many tokens
    as their size gives, placed by M-RoPE, LLaVA-NeXT's to a grid of tiles their size chooses,
    Gemma 3's to soft tokens that see each other (each equal to transformers in
    tests/inference/test_images_idefics3.py, test_images_qwen2_vl.py, test_images_llava_next.py
    and test_images_gemma3.py); over the API they answer as in the engine."""
    import openai

    directory = request.getfixturevalue(checkpoint)
    with serving(make_engine(directory, max_seq_len=1024)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        content = openai_content(image_bytes(1), image_bytes(2))
        assert openai_answer(client, content) == engine_answer(server.engine, 1, 2)
        assert openai_answer(client, openai_content(image_bytes(1))) != openai_answer(
            client, openai_content(image_bytes(2))
        )


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF"])
def test_other_formats_decode_to_the_same_pixels_as_the_engine_reads_them(
    llava_server, clients, fmt
):
    """The server answers what the engine answers to the image as the file decodes."""
    from PIL import Image

    openai_client, _ = clients
    data = image_bytes(3, fmt)
    decoded = Image.open(io.BytesIO(data))
    parts = [{"type": "image", "image": decoded}, {"type": "text", "text": QUESTION}]
    request = GenerationRequest(
        [{"role": "user", "content": parts}],
        GenerationParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )
    expected = llava_server.engine.generate(request)
    content = [
        {"type": "image_url", "image_url": {"url": data_url(data, f"image/{fmt.lower()}")}},
        {"type": "text", "text": QUESTION},
    ]
    assert openai_answer(openai_client, content) == expected


def test_responses_input_image_parts(llava_server, clients):
    openai_client, _ = clients
    reply = openai_client.responses.create(
        model="tiny-llama",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(image_bytes(1))},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        temperature=0,
        max_output_tokens=MAX_TOKENS,
    )
    assert reply.output_text == engine_answer(llava_server.engine, 1)


def test_anthropic_image_blocks(llava_server, clients):
    _, anthropic_client = clients
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(image_bytes(1)).decode(),
    }
    reply = anthropic_client.messages.create(
        model="tiny-llama",
        max_tokens=MAX_TOKENS,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": source},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        extra_body={"temperature": 0},
    )
    assert reply.content[0].text == engine_answer(llava_server.engine, 1)


def test_ollama_images_on_chat_and_generate(llava_server):
    expected = engine_answer(llava_server.engine, 1)
    image = base64.b64encode(image_bytes(1)).decode()
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat = httpx.post(
        f"{llava_server.base_url}/api/chat",
        json={
            "model": "tiny-llama",
            "stream": False,
            "options": options,
            "messages": [{"role": "user", "content": QUESTION, "images": [image]}],
        },
        headers=headers,
        timeout=60,
    )
    generate = httpx.post(
        f"{llava_server.base_url}/api/generate",
        json={
            "model": "tiny-llama",
            "stream": False,
            "options": options,
            "prompt": QUESTION,
            "images": [image],
        },
        headers=headers,
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert generate.status_code == 200, generate.text
    assert chat.json()["message"]["content"] == expected
    assert generate.json()["response"] == expected


REFUSALS = {
    "remote URL": (
        [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}],
        "does not fetch images from URLs",
    ),
    "bomb": (
        [{"type": "image_url", "image_url": {"url": data_url(png_bomb(100_000, 100_000))}}],
        "pixels",
    ),
    "over the pixel limit": (
        [{"type": "image_url", "image_url": {"url": data_url(png_bomb(201, 200))}}],
        "201x200 pixels, over the limit of 40000",
    ),
    "corrupt": (
        [{"type": "image_url", "image_url": {"url": data_url(b"\x89PNG\r\n\x1a\nnot really")}}],
        "messages\\[0\\]'s image 1 is not a readable image",
    ),
    "not base64": (
        [{"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}],
        "not valid base64",
    ),
    "too many": (
        openai_content(image_bytes(1), image_bytes(2), image_bytes(3)),
        "over the limit of 2",
    ),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refusals_are_clear_400s_and_the_server_serves_on(llava_server, clients, name):
    import openai

    openai_client, _ = clients
    content, message = REFUSALS[name]
    with pytest.raises(openai.BadRequestError, match=message) as refused:
        openai_answer(openai_client, content)
    assert "PIL" not in str(refused.value) and "Traceback" not in str(refused.value)
    assert openai_answer(openai_client, openai_content(image_bytes(1))) == engine_answer(
        llava_server.engine, 1
    )


def test_anthropic_url_sources_are_refused(clients):
    import anthropic

    _, anthropic_client = clients
    with pytest.raises(anthropic.BadRequestError, match="does not fetch images from URLs"):
        anthropic_client.messages.create(
            model="tiny-llama",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://a.com/b.png"}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
        )


def test_a_text_only_model_refuses_images(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError, match="reads text only"):
        openai_answer(openai_client, openai_content(image_bytes(1)))
    assert openai_answer(openai_client, [{"type": "text", "text": QUESTION}])
