"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe).

Chromium reads NUL-terminated JSON commands on descriptor 3 and answers on descriptor 4,
so no websocket library or open port is needed.
"""

import base64
import json
import os
import shutil
import subprocess
import time

CHROMIUM = shutil.which("chromium")
# Seconds to wait for one answer before calling the browser stuck.
ANSWER_TIMEOUT = 60


def unavailable_reason() -> str | None:
    if CHROMIUM is None:
        return (
            "chromium is not installed (Debian's chromium package; .ci/run installs it via "
            "envs/base/setup-chromium.sh when run as root with apt)"
        )
    return None


class Page:
    """One tab of a headless Chromium."""

    def __init__(self, profile_dir, width=1400, height=1000):
        commands_r, commands_w = os.pipe()
        answers_r, answers_w = os.pipe()

        def wire_descriptors():
            os.dup2(commands_r, 3)
            os.dup2(answers_w, 4)

        # --no-sandbox: the test may run as root, where Chromium's sandbox refuses to start.
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-pipe", f"--user-data-dir={profile_dir}",
             f"--window-size={width},{height}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=wire_descriptors,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(commands_r)
        os.close(answers_w)
        self._commands, self._answers = commands_w, answers_r
        self._buffer, self._last_id = b"", 0
        target = self.command("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.command("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.command("Page.enable", page=True)

    def _message(self) -> dict:
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer within a minute")
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def command(self, method, page=False, **params) -> dict:
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params}
        if page:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._message()
            if answer.get("id") == self._last_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def open(self, url):
        self.command("Page.navigate", page=True, url=url)

    def evaluate(self, expression, context_id=None):
        """The value of a JavaScript expression (promises awaited) in the page or a frame."""
        params = {"expression": expression, "returnByValue": True, "awaitPromise": True}
        if context_id is not None:
            params["contextId"] = context_id
        result = self.command("Runtime.evaluate", page=True, **params)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def frame_contexts(self) -> list[int]:
        """An execution context in each child frame (iframes, whatever their origin)."""
        tree = self.command("Page.getFrameTree", page=True)["frameTree"]
        contexts = []
        for child in tree.get("childFrames", []):
            world = self.command(
                "Page.createIsolatedWorld", page=True, frameId=child["frame"]["id"]
            )
            contexts.append(world["executionContextId"])
        return contexts

    def screenshot(self, path):
        data = self.command("Page.captureScreenshot", page=True, format="png")["data"]
        with open(path, "wb") as handle:
            handle.write(base64.b64decode(data))

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._answers)
