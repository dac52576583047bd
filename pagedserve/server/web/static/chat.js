// The chat playground: streams /v1/chat/completions into the conversation and reports, per
// answer, the time to first token and the tokens per second. Stop aborts the fetch; the server
// sees the connection close and aborts the request in the engine (its KV blocks are freed).

import { auth, authHeaders, errorMessage, readSSE } from "./api.js";
import { el, fmt } from "./format.js";

const $ = (id) => document.getElementById(id);

export class Chat {
  constructor() {
    this.messages = [];
    this.controller = null;
    this.log = $("chat-log");
    this.input = $("chat-input");
    this.send = $("chat-send");
    this.stop = $("chat-stop");
    if (auth.required) {
      $("chat-key-label").hidden = false;
      $("chat-key").value = auth.key;
    }
    $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); this.ask(); });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.ask(); }
    });
    this.stop.addEventListener("click", () => this.controller && this.controller.abort());
    $("chat-clear").addEventListener("click", () => { if (!this.controller) { this.messages = []; this.log.replaceChildren(); } });
  }

  async loadModels() {
    const select = $("chat-model");
    const response = await fetch("/v1/models", { headers: authHeaders(this.key()) });
    if (!response.ok) return;
    const models = (await response.json()).data || [];
    select.replaceChildren(...models.map((m) => el("option", { value: m.id, text: m.id })));
    if (!models.length) return;
    document.getElementById("model-name").textContent = models[0].id;
    // a default answer length that fits the context with room for the conversation
    const maxTokens = $("chat-max-tokens");
    const limit = models[0].max_model_len;
    if (limit) {
      maxTokens.max = String(limit);
      maxTokens.value = String(Math.min(Number(maxTokens.value), Math.floor(limit / 2)));
    }
  }

  key() {
    return auth.required ? $("chat-key").value.trim() : "";
  }

  request() {
    const system = $("chat-system").value.trim();
    const number = (id) => Number($(id).value);
    return {
      model: $("chat-model").value,
      messages: [...(system ? [{ role: "system", content: system }] : []), ...this.messages],
      temperature: number("chat-temperature"),
      top_p: number("chat-top-p"),
      max_tokens: Math.round(number("chat-max-tokens")),
      stream: true,
      stream_options: { include_usage: true },
    };
  }

  addMessage(role, text) {
    const body = el("div", { class: "text", text });
    const node = el("div", { class: "msg " + role, "data-role": role }, body);
    this.log.append(node);
    this.log.scrollTop = this.log.scrollHeight;
    return { node, body };
  }

  busy(on) {
    this.send.disabled = on;
    this.stop.disabled = !on;
  }

  async ask() {
    const text = this.input.value.trim();
    if (!text || this.controller) return;
    this.input.value = "";
    this.messages.push({ role: "user", content: text });
    this.addMessage("user", text);
    const answer = this.addMessage("assistant", "");
    answer.node.classList.add("streaming");
    const stats = el("div", { class: "answer-stats muted small" });
    answer.node.append(stats);

    const controller = (this.controller = new AbortController());
    this.busy(true);
    const t0 = performance.now();
    let tFirst = null, chunks = 0, usage = null, finish = null, content = "", failure = null;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders(this.key()) },
        body: JSON.stringify(this.request()),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      for await (const ev of readSSE(response)) {
        if (ev.data === "[DONE]") break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            if (tFirst === null) tFirst = performance.now();
            content += delta;
            chunks += 1;
            answer.body.textContent = content;
            this.log.scrollTop = this.log.scrollHeight;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else failure = e.message;
    } finally {
      this.controller = null;
      this.busy(false);
      answer.node.classList.remove("streaming");
    }
    const tEnd = performance.now();
    if (failure) {
      answer.node.classList.add("error");
      answer.body.textContent = content + (content ? "\n" : "") + "Error: " + failure;
      this.messages.pop();
      return;
    }
    if (content) this.messages.push({ role: "assistant", content });
    else this.messages.pop();
    // tokens: the usage chunk when the stream completed, else one per streamed piece
    const tokens = usage ? usage.completion_tokens : chunks;
    const ttft = tFirst === null ? null : (tFirst - t0) / 1000;
    const decodeS = tFirst === null ? 0 : (tEnd - tFirst) / 1000;
    const tps = tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : null;
    answer.node.dataset.finish = finish || "";
    stats.dataset.ttftMs = ttft === null ? "" : String(1000 * ttft);
    stats.dataset.tokens = String(tokens);
    stats.dataset.tps = tps === null ? "" : String(tps);
    stats.textContent = `TTFT ${fmt.seconds(ttft)} \u00b7 ${fmt.rate(tps)} tokens/s \u00b7 ${tokens} tokens` +
      (usage ? "" : " (streamed pieces)") + ` \u00b7 ${finish || "?"}`;
  }
}
