// Requests to the server: the API key (when the server has one) and a reader for
// server-sent events over fetch (EventSource cannot send an Authorization header).

const KEY_STORE = "pagedserve-api-key";

export const auth = {
  required: document.body.dataset.auth === "required",
  key: sessionStorage.getItem(KEY_STORE) || "",
};

export function setKey(key) {
  auth.key = key;
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
}

export class Unauthorized extends Error {}

export function authHeaders(key = auth.key) {
  return key ? { Authorization: "Bearer " + key } : {};
}

export async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch {
    return response.statusText || "HTTP " + response.status;
  }
}

// fetch with the key; a 401 becomes Unauthorized so that callers can ask for the key again.
export async function api(path, options = {}) {
  const headers = { ...authHeaders(), ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) throw new Unauthorized(await errorMessage(response));
  return response;
}

// Yields {event, data} for each server-sent event of a streaming response body.
export async function* readSSE(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (!line || line.startsWith(":")) continue;
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") event = value;
          else if (field === "data") data.push(value);
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  } finally {
    reader.releaseLock();
  }
}
