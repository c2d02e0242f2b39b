// octo dashboard, Playground: chat (streaming, with TTFT, tok/s and prefix-cache hits; images attached or pasted for a
// model that takes them), transcription (a file or the microphone) and embeddings (first values and norm), each with
// the models of its task the server has.
"use strict";
octo.playground = (() => {
  const { el, json, num, showError } = octo;
  const $ = (id) => document.getElementById(id);
  const conversation = [];  // {role, content}: content a string, or text and image_url parts
  const images = [];  // data URLs of the images the next message sends
  let controller = null;

  // -- model pickers: the models that serve the picker's task (loaded or servable on demand: a loaded model's tasks,
  // else its main task); a LoRA adapter (parent) only for chat --
  const NONE = { chat: "no chat model: serve one, e.g. demo", transcription: "no speech model: serve one, e.g. " +
    "demo-whisper", embeddings: "no embedding model: serve one, e.g. nomic-embed-text-v1.5" };
  octo.onModels((list) => {
    for (const sel of document.querySelectorAll(".model-select")) {
      const task = sel.dataset.task, prev = sel.value;
      const fits = (m) => (m.task === task || (m.tasks || []).includes(task)
        || (task === "chat" && m.task === "completion")) && (!m.parent || task === "chat") && m.state !== "failed";
      const models = list.filter(fits);
      sel.replaceChildren(...(models.length ? models.map((m) => el("option", { value: m.id,
        text: m.state === "ready" ? m.id : `${m.id} (${m.state})` }))
        : [el("option", { value: "", text: NONE[task] || "no model of this task" })]));
      sel.disabled = !models.length;
      if (prev && models.some((m) => m.id === prev)) sel.value = prev;
    }
    showAttach();
  });

  // -- images: a file picker and paste, offered only for a model that takes images (capabilities: vision) --
  function takesImages() {
    const m = octo.models().find((x) => x.id === $("chat-model").value);
    return !!(m && (m.capabilities || []).includes("vision"));
  }
  function showAttach() {
    $("chat-attach").hidden = !takesImages();
    if ($("chat-attach").hidden) setImages([]);
  }
  function setImages(urls) {
    images.splice(0, images.length, ...urls);
    $("chat-images").replaceChildren(...images.map((u, i) => el("img", { src: u, alt: `image ${i + 1}` })));
    $("chat-images-clear").hidden = !images.length;
  }
  function addFiles(files) {
    for (const f of files) {
      if (!f.type.startsWith("image/")) continue;
      const reader = new FileReader();
      reader.onload = () => setImages([...images, reader.result]);
      reader.readAsDataURL(f);
    }
  }
  $("chat-model").addEventListener("change", showAttach);
  $("chat-image").addEventListener("change", (e) => { addFiles(e.target.files); e.target.value = ""; });
  $("chat-images-clear").addEventListener("click", () => setImages([]));
  $("chat-input").addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
    if (!files.length || !takesImages()) return;
    e.preventDefault();
    addFiles(files);
  });

  // -- chat --
  function bubble(role, text, urls = []) {
    const body = el("span", { class: "text", text });
    const b = el("div", { class: "msg " + role, "data-role": role },
      ...urls.map((u, i) => el("img", { src: u, alt: `image ${i + 1}` })), body);
    $("chat-log").append(b);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return { b, body };
  }

  async function sendChat(ev) {
    ev.preventDefault();
    const text = $("chat-input").value.trim();
    if ((!text && !images.length) || controller) return;
    showError("chat-error", null);
    const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
    conversation.push({ role: "user", content: parts.length ? [{ type: "text", text }, ...parts] : text });
    bubble("user", text, [...images]);
    $("chat-input").value = "";
    setImages([]);
    const messages = [];
    const system = $("chat-system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...conversation);
    const body = { model: $("chat-model").value, messages, stream: true, stream_options: { include_usage: true } };
    const temp = $("chat-temperature").value, maxTok = $("chat-max-tokens").value;
    if (temp !== "") body.temperature = Number(temp);
    if (maxTok !== "") body.max_tokens = Number(maxTok);
    const stops = $("chat-stop").value.split("\n").filter((s) => s.length);
    if (stops.length) body.stop = stops.slice(0, 4);
    if ($("chat-json").checked) body.response_format = { type: "json_object" };
    const { b, body: out } = bubble("assistant", "");
    out.textContent = "…";
    let reply = "", first = null, usage = null, finish = null, chunks = 0, failed = false;
    const t0 = performance.now();
    controller = new AbortController();
    setBusy(true);
    try {
      await octo.sse("/v1/chat/completions", { method: "POST", body }, (chunk) => {
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          const piece = (c.delta && c.delta.content) || "";
          if (piece) {
            if (first === null) first = performance.now();
            reply += piece; chunks++;
            out.textContent = reply;
            $("chat-log").scrollTop = $("chat-log").scrollHeight;
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
      }, controller.signal);
    } catch (err) {
      if (err.name !== "AbortError") { showError("chat-error", err); failed = true; }
      else finish = "stopped";
    } finally {
      controller = null;
      setBusy(false);
    }
    const t1 = performance.now();
    if (failed && !reply) {  // nothing came back: the turn is not part of the conversation
      conversation.pop();
      out.textContent = "(error: see above)";
      b.classList.add("failed");
      return;
    }
    if (!reply) out.textContent = finish === "stopped" ? "(stopped)" : "(no text)";
    conversation.push({ role: "assistant", content: reply });
    b.append(meta(t0, first, t1, usage, finish, chunks));
  }

  function meta(t0, first, t1, usage, finish, chunks) {
    const parts = [];
    if (first !== null) parts.push(`TTFT ${num(first - t0, 0)} ms`);
    const n = usage ? usage.completion_tokens : chunks;
    if (first !== null && n > 1 && t1 > first) parts.push(`${num((n - 1) / ((t1 - first) / 1000))} tok/s`);
    if (usage) {
      parts.push(`${usage.completion_tokens} tokens`);
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(cached ? `prefix cache hit: ${cached} of ${usage.prompt_tokens} prompt tokens`
        : `prefix cache: miss (${usage.prompt_tokens} prompt tokens)`);
      const pictured = (usage.prompt_tokens_details || {}).image_tokens;
      if (pictured) parts.push(`${pictured} image tokens`);
    }
    if (finish) parts.push(`finish: ${finish}`);
    return el("span", { class: "meta", text: parts.join(" · ") });
  }

  function setBusy(busy) {
    $("chat-send").disabled = busy;
    $("chat-stop-button").disabled = !busy;
  }

  $("chat-form").addEventListener("submit", sendChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("chat-stop-button").addEventListener("click", () => controller && controller.abort());
  $("chat-clear").addEventListener("click", () => {
    conversation.length = 0; $("chat-log").replaceChildren(); setImages([]);
  });

  // -- transcription --
  async function transcribe(blob, filename) {
    showError("stt-error", null);
    $("stt-text").textContent = "transcribing…";
    const form = new FormData();
    form.append("file", blob, filename);
    form.append("model", $("stt-model").value);
    form.append("response_format", "json");
    const t0 = performance.now();
    try {
      const r = await json("/v1/audio/transcriptions", { method: "POST", body: form });
      $("stt-text").textContent = r.text;
      $("stt-info").textContent = `${filename}: ${num((performance.now() - t0) / 1000, 2)} s`;
    } catch (err) {
      $("stt-text").textContent = "";
      showError("stt-error", err);
    }
  }
  $("stt-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const f = $("stt-file").files[0];
    if (!f) { showError("stt-error", new Error("Choose an audio file first.")); return; }
    transcribe(f, f.name);
  });

  let recorder = null;
  const canRecord = !!(navigator.mediaDevices && navigator.mediaDevices.getUserMedia && window.MediaRecorder);
  if (!canRecord) {
    $("stt-record").disabled = true;
    $("stt-record").title = "This browser does not allow recording here (it needs https or localhost).";
  }
  $("stt-record").addEventListener("click", async () => {
    if (recorder) { recorder.stop(); return; }
    try {
      const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
      const parts = [];
      recorder = new MediaRecorder(stream);
      recorder.ondataavailable = (e) => parts.push(e.data);
      recorder.onstop = () => {
        stream.getTracks().forEach((t) => t.stop());
        const type = recorder.mimeType || "audio/webm";
        recorder = null;
        $("stt-record").textContent = "Record";
        transcribe(new Blob(parts, { type }), "recording." + (type.includes("ogg") ? "ogg" : "webm"));
      };
      recorder.start();
      $("stt-record").textContent = "Stop recording";
    } catch (err) {
      showError("stt-error", err);
    }
  });

  // -- embeddings --
  $("emb-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    showError("emb-error", null);
    try {
      const r = await json("/v1/embeddings", { method: "POST",
                                               body: { model: $("emb-model").value, input: $("emb-input").value } });
      const v = r.data[0].embedding;
      const norm = Math.sqrt(v.reduce((a, x) => a + x * x, 0));
      $("emb-out").replaceChildren(
        el("div", {}, el("strong", { text: `${v.length} dimensions` }), ` · norm ${norm.toFixed(4)} · `,
           `${r.usage ? r.usage.prompt_tokens : "?"} tokens`),
        el("code", { id: "emb-values", text: "[" + v.slice(0, 8).map((x) => x.toFixed(4)).join(", ")
          + (v.length > 8 ? ", …]" : "]") }),
        octo.charts.vector(v.slice(0, 64)));
    } catch (err) {
      $("emb-out").replaceChildren();
      showError("emb-error", err);
    }
  });
  return {};
})();
