// Boot: behind --api-key, nothing is fetched until a key the server accepts is entered.

import { auth, setKey, Unauthorized } from "./api.js";
import { Chat } from "./chat.js";
import { loadConfig } from "./config.js";
import { Dashboard } from "./dashboard.js";

const $ = (id) => document.getElementById(id);
let dashboard = null;
let chat = null;

function askForKey(message) {
  $("app").hidden = true;
  $("auth").hidden = false;
  $("auth-error").textContent = message || "";
  $("feed-status").dataset.state = "locked";
  $("feed-status").textContent = "API key needed";
  $("auth-key").focus();
}

function keyRefused(message) {
  setKey("");
  askForKey(message);
}

async function start() {
  await loadConfig(); // throws Unauthorized for a wrong key: nothing is shown then
  $("auth").hidden = true;
  $("app").hidden = false;
  chat = chat || new Chat();
  chat.loadModels();
  dashboard = dashboard || new Dashboard((msg) => keyRefused("The server refused the key: " + msg));
  dashboard.run();
}

$("auth-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  setKey($("auth-key").value.trim());
  try {
    await start();
  } catch (err) {
    keyRefused(err instanceof Unauthorized ? "The server refused this key." : String(err.message || err));
  }
});

if (auth.required && !auth.key) {
  askForKey();
} else {
  start().catch((err) => {
    if (err instanceof Unauthorized) keyRefused("The stored key was refused.");
    else { $("feed-status").dataset.state = "down"; $("feed-status").textContent = String(err.message || err); }
  });
}
