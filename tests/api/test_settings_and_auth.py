"""GET/PUT /v1/settings (persistence across restarts, the environment override) and the API key."""

from __future__ import annotations

import json

import openai
import pytest

BODY = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}


def _stats(http) -> dict:
    response = http.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200
    return response.json()["usage"]["native_mtp"]


def test_settings_persist_across_restarts_and_env_overrides(make_server, model_dir, tmp_path):
    home = tmp_path / "home"
    first = make_server(model_dir, home=home)
    with first.http() as http:
        view = http.get("/v1/settings").json()
        assert view["native_mtp_enabled"] is True and view["sources"] == {"native_mtp_enabled": "default"}
        assert view["env_overrides"] == {}
        assert _stats(http)["enabled"] is True
        updated = http.put("/v1/settings", json={"native_mtp_enabled": False}).json()
        assert updated["native_mtp_enabled"] is False and updated["sources"]["native_mtp_enabled"] == "api"
        stats = _stats(http)  # the very next request
        assert stats["enabled"] is False and "PUT /v1/settings" in stats["reason"]
        model = http.get(f"/v1/models/{first.model}").json()
        assert model["native_mtp"]["available"] is False and "disabled" in model["native_mtp"]["reason"]
    assert json.loads((home / "settings.json").read_text()) == {"native_mtp_enabled": False}
    first.stop()

    second = make_server(model_dir, home=home)  # a restart reads the settings file
    with second.http() as http:
        view = http.get("/v1/settings").json()
        assert view["native_mtp_enabled"] is False and view["sources"]["native_mtp_enabled"] == "file"
        stats = _stats(http)
        assert stats["enabled"] is False and "settings file" in stats["reason"]
    second.stop()

    third = make_server(model_dir, home=home, env={"EXO_NATIVE_MTP_ENABLED": "1"})  # the environment wins
    with third.http() as http:
        view = http.get("/v1/settings").json()
        assert view["native_mtp_enabled"] is True and view["sources"]["native_mtp_enabled"] == "env"
        assert view["env_overrides"] == {"native_mtp_enabled": "EXO_NATIVE_MTP_ENABLED"}
        assert _stats(http)["enabled"] is True
    third.stop()

    fourth = make_server(model_dir, home=home, env={"EXO_NATIVE_MTP_ENABLED": "0"})
    with fourth.http() as http:
        stats = _stats(http)
        assert stats["enabled"] is False and "EXO_NATIVE_MTP_ENABLED=0" in stats["reason"]
        http.put("/v1/settings", json={"native_mtp_enabled": True})
        assert _stats(http)["enabled"] is True
    assert json.loads((home / "settings.json").read_text()) == {"native_mtp_enabled": True}


def test_settings_file_keeps_other_keys(make_server, model_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "settings.json").write_text(json.dumps({"dashboard": {"theme": "dark"}}))
    srv = make_server(model_dir, home=home)
    with srv.http() as http:
        http.put("/v1/settings", json={"native_mtp_enabled": False})
    assert json.loads((home / "settings.json").read_text()) == {
        "dashboard": {"theme": "dark"},
        "native_mtp_enabled": False,
    }


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"native_mtp_enabled": "yes"}, "invalid_type"),
        ({"native_mtp_enabled": 1}, "invalid_type"),
        ({}, "missing_required_parameter"),
        ({"native_mtp_enabled": True, "api_port": 1}, "unknown_parameter"),
    ],
)
def test_bad_settings_updates(server, body, code):
    with server.http() as http:
        response = http.put("/v1/settings", json=body)
        assert response.status_code == 400 and response.json()["error"]["code"] == code
        assert http.get("/v1/settings").json()["native_mtp_enabled"] is True


def test_api_key(make_server, model_dir):
    srv = make_server(model_dir, env={"EXO_API_KEY": "s3cret"})
    with srv.http() as authed:
        assert authed.get("/v1/models").status_code == 200
        assert authed.get("/health").status_code == 200
    with srv.http() as http:
        http.headers.clear()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/settings")):
                response = http.request(method, path, headers=headers, json=BODY if method == "POST" else None)
                assert response.status_code == 401, (headers, path)
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert response.headers["WWW-Authenticate"] == "Bearer"
        assert http.get("/health").status_code == 200  # stays open
    assert srv.openai().chat.completions.create(model=srv.model, messages=BODY["messages"], max_tokens=4).choices
    with pytest.raises(openai.AuthenticationError):
        srv.openai(api_key="wrong").models.list()
