import { mount } from "svelte";

import App from "./App.svelte";
import "./app.css";
import { ChatStore } from "./lib/chat.svelte";
import { Session } from "./lib/session.svelte";
import { UI } from "./lib/ui.svelte";

const session = new Session({ storage: localStorage });
const chat = new ChatStore(session.api, localStorage);
const ui = new UI(localStorage);
void session.start();

mount(App, { target: document.getElementById("app")!, props: { session, chat, ui } });
