"""A preset's draft vocabulary (draft_vocab, draft_vocab_text): its keys are validated by name;
the service ranks the text's most frequent tokens (the stop ids always in) and gives verified
mode's full draft a head over them only, whose replies are still the exact greedy replies, also
where they use tokens the draft cannot propose; the other modes keep the full head; the page's
header says how many tokens the head scores; app.py refuses, by name, a draft_vocab that the
loaded model cannot have."""

import pytest
from app_server import free_port
from test_service import reference_reply, reply_tokens, run, user

from app import main as app_main
from ui.page import header
from unimax.draft_vocab import SubsetHead
from unimax.presets import Preset, PresetError, load_preset, preset_from_dict
from unimax.service import EngineService, GenerationSettings


def test_preset_keys_are_validated_by_name(tmp_path):
    text = tmp_path / "chats.txt"
    text.write_text("hello there")
    with pytest.raises(PresetError, match="'draft_vocab' .*set draft: full"):
        preset_from_dict({"draft_vocab": 8, "draft_vocab_text": str(text)})  # draft: tail
    with pytest.raises(PresetError, match="'draft_vocab_text' .*required with draft_vocab"):
        preset_from_dict({"draft": "full", "draft_vocab": 8})
    with pytest.raises(PresetError, match="'draft_vocab_text' .*an existing text file"):
        preset_from_dict({"draft": "full", "draft_vocab": 8,
                          "draft_vocab_text": str(tmp_path / "missing.txt")})
    with pytest.raises(PresetError, match="'draft_vocab_text' .*empty unless draft_vocab"):
        preset_from_dict({"draft_vocab_text": str(text)})
    for bad in (0, -3, True, 2.5, "many"):
        with pytest.raises(PresetError, match="'draft_vocab' has the value"):
            preset_from_dict({"draft": "full", "draft_vocab": bad,
                              "draft_vocab_text": str(text)})
    # a relative path is the preset file's neighbour, wherever the app is started from
    (tmp_path / "mine.yaml").write_text("model: tiny-random\ndraft: full\ndraft_vocab: 8\n"
                                        "draft_vocab_text: chats.txt\n")
    assert load_preset(tmp_path / "mine.yaml").draft_vocab_text == str(text)


def test_verified_drafts_from_the_texts_most_frequent_tokens_and_stays_exact(tmp_path):
    text = tmp_path / "chats.txt"
    text.write_text("e" * 50 + "t" * 40 + "a" * 30 + "z")  # z: the text's one token outside
    preset = Preset(model="tiny-random", block_size=4, draft="full", draft_vocab=5,
                    draft_vocab_text=str(text),
                    generation=GenerationSettings(max_new_tokens=24))
    service = EngineService(preset).start()
    try:
        assert len(service.stop_ids) == 2  # (tiny-random's): 5 = the stop ids and 3 letters
        letters = service.tokenizer.convert_tokens_to_ids(["e", "t", "a"])
        assert service.draft_vocab == sorted({*service.stop_ids, *letters})
        assert service.draft_vocab_coverage == pytest.approx(120 / 121)
        for conversation, message in (("one", "Hello"), ("two", "tea")):
            events = run(service, conversation, [user(message)], mode="verified",
                         max_new_tokens=24)
            assert events[-1].kind == "done", events[-1].text
            got = reply_tokens(service, events)
            assert got == reference_reply(service, [user(message)], 24)
            # the exact model picks tokens the draft cannot propose: rejected there, emitted
            assert any(t not in service.draft_vocab for t in got)
        # the page says so (its header), and what the draft is without one
        assert header(service, preset).endswith(
            "verified draft `full` (its head over 5 of 259 tokens)")
        plain = EngineService(Preset(model="tiny-random", draft="full"),
                              model=service.model, tokenizer=service.tokenizer)
        assert header(plain, plain.preset).endswith("verified draft `full`")
        head = service.engines["verified"].decode_model.lm_head  # the full draft's
        assert isinstance(head, SubsetHead) and head.ids.tolist() == service.draft_vocab
        assert run(service, "three", [user("Hi")], mode="fp8", max_new_tokens=4)[-1].kind == "done"
        assert not isinstance(service.engines["fp8"].decode_model.lm_head, SubsetHead)
    finally:
        service.stop()


def test_bad_draft_vocab_for_the_model_is_refused_by_name(tmp_path, capsys):
    text = tmp_path / "chats.txt"
    text.write_text("hello")
    preset = tmp_path / "big.yaml"
    preset.write_text("model: tiny-random\ndraft: full\ndraft_vocab: 100000\n"
                      "draft_vocab_text: chats.txt\n")
    with pytest.raises(PresetError, match="'draft_vocab' is 100000, more than this model's "
                                          "259 tokens"):  # (first: app.py would then serve)
        EngineService(load_preset(preset))
    assert app_main(["--preset", str(preset), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "'draft_vocab' is 100000, more than this model's 259 tokens" in err
    with pytest.raises(PresetError, match="'draft_vocab' is 1, fewer than this model's 2 stop"):
        EngineService(Preset(model="tiny-random", draft="full", draft_vocab=1,
                             draft_vocab_text=str(text)))
    text.write_text("   \n")
    with pytest.raises(PresetError, match="'draft_vocab_text': .* has no text"):
        EngineService(Preset(model="tiny-random", draft="full", draft_vocab=8,
                             draft_vocab_text=str(text)))
    text.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(PresetError, match="cannot read .* as UTF-8 text"):
        EngineService(Preset(model="tiny-random", draft="full", draft_vocab=8,
                             draft_vocab_text=str(text)))
