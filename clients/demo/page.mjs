// @ts-check
/**
 * The demo page of `tally vote --demo`: one video and its twenty comments,
 * each with like and dislike buttons drawn by the reference client's
 * `Reaction` (optimistic, one key per click, retried safely), and counts
 * read again every few seconds so that other tabs' and users' votes show.
 *
 * Query parameters: `user` (who to sign in as), `video` (the video's id;
 * its comments are `<video>-c1` to `<video>-c20`), `poll` (ms between
 * reads of the counts; 0 for none).
 */
import { TallyClient, Reaction } from "/demo/tally.mjs";

const params = new URLSearchParams(location.search);
const video = params.get("video") || "demo-video";
const pollMs = Number(params.get("poll") ?? 5000);
const user = params.get("user") || localStorage.getItem("tally-demo-user") || "alice";

const AUTHORS = ["ana", "bo", "chen", "dara", "eli", "femi", "gus", "hana", "ivo", "jun",
  "kai", "lea", "mo", "nia", "oto", "pia", "quinn", "ras", "sol", "tam"];
const TEXTS = [
  "The part at 2:10 is the best explanation I have seen.",
  "Could you do one on the consumer's fencing next?",
  "I liked it twice and it only counted once. As it should.",
  "Subtitles would help.",
  "This finally made idempotency keys click for me.",
  "Audio is a bit quiet in the middle section.",
  "Great pacing.",
  "Why not just increment a counter? (I know, I know.)",
  "Watched on a train with a terrible connection; my like still landed.",
  "More of these, please.",
  "The diagram of the outbox is worth the whole video.",
  "Does this hold when a broker dies mid-publish?",
  "Clear and short. Thank you.",
  "I showed this to my team; we are rewriting our like button.",
  "The double-click demo made me laugh.",
  "What happens to my vote if the server crashes right after saying yes?",
  "Nice to see the counts match after all that chaos.",
  "Could you share the slides?",
  "Second time watching, still learning something.",
  "A like is a state, not an increment. Noted.",
];

const comments = Array.from({ length: 20 }, (_, i) => ({
  id: `${video}-c${i + 1}`,
  author: AUTHORS[i % AUTHORS.length],
  text: TEXTS[i % TEXTS.length],
}));
const ids = [video, ...comments.map((c) => c.id)];

/** @param {string} name */
async function login(name) {
  const res = await fetch("/demo/login", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ user: name }),
  });
  const body = await res.json();
  if (!res.ok) throw new Error(body?.error?.message ?? `login failed (${res.status})`);
  return /** @type {string} */ (body.token);
}

/**
 * One row: the text, then a like and a dislike button drawn from the
 * Reaction's view.
 * @param {HTMLElement} row
 * @param {string} id
 * @param {"video" | "comment"} type
 * @param {string} html
 */
function buildRow(row, id, type, html) {
  row.classList.add("item");
  row.dataset.target = id;
  row.dataset.type = type;
  row.innerHTML = `<div class="text">${html}</div>
    <div class="buttons">
      <button type="button" data-action="like" aria-pressed="false">Like <span class="count">0</span></button>
      <button type="button" data-action="dislike" aria-pressed="false">Dislike <span class="count">0</span></button>
    </div>`;
  const error = document.createElement("div");
  error.className = "error";
  error.setAttribute("role", "alert");
  row.querySelector(".text")?.append(error);
  return row;
}

/** @param {string} s */
function escape(s) {
  return s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

async function main() {
  const status = /** @type {HTMLElement} */ (document.getElementById("status"));
  const input = /** @type {HTMLInputElement} */ (document.getElementById("user"));
  input.value = user;
  document.getElementById("login")?.addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem("tally-demo-user", input.value);
    const next = new URL(location.href);
    next.searchParams.set("user", input.value);
    location.href = next.toString();
  });

  const token = await login(user);
  const client = new TallyClient({ baseUrl: location.origin, token: () => token });
  const first = await client.summary(ids);

  /** @type {Map<string, Reaction>} */
  const reactions = new Map();
  const rows = [
    buildRow(/** @type {HTMLElement} */ (document.getElementById("video")), video, "video", `<strong>${escape(video)}</strong>: how tally counts a like exactly once`),
    ...comments.map((c) => {
      const row = document.createElement("div");
      document.getElementById("comments")?.append(row);
      return buildRow(row, c.id, "comment", `<span class="author">@${c.author}</span>${escape(c.text)}`);
    }),
  ];
  for (const row of rows) {
    const id = /** @type {string} */ (row.dataset.target);
    const type = /** @type {"video" | "comment"} */ (row.dataset.type);
    const [like, dislike] = /** @type {HTMLButtonElement[]} */ ([...row.querySelectorAll("button")]);
    const error = /** @type {HTMLElement} */ (row.querySelector(".error"));
    const reaction = new Reaction(client, id, type, first[id] ?? { likes: 0, dislikes: 0, user_state: "none" }, ({ counts, pending, error: message }) => {
      /** @type {HTMLElement} */ (like.querySelector(".count")).textContent = String(counts.likes);
      /** @type {HTMLElement} */ (dislike.querySelector(".count")).textContent = String(counts.dislikes);
      like.setAttribute("aria-pressed", String(counts.user_state === "like"));
      dislike.setAttribute("aria-pressed", String(counts.user_state === "dislike"));
      row.dataset.pending = String(pending);
      row.dataset.state = counts.user_state;
      row.dataset.likes = String(counts.likes);
      row.dataset.dislikes = String(counts.dislikes);
      error.textContent = message ? `Not saved: ${message}` : "";
    });
    like.addEventListener("click", () => reaction.click("like"));
    dislike.addEventListener("click", () => reaction.click("dislike"));
    reactions.set(id, reaction);
  }

  /** Reads the counts again; a button with a vote under way keeps its own. */
  async function refresh() {
    const generations = new Map([...reactions].map(([id, r]) => [id, r.generation]));
    try {
      const fresh = await client.summary(ids);
      for (const [id, r] of reactions) {
        const counts = fresh[id];
        const generation = generations.get(id);
        if (counts && generation !== undefined) r.refresh(counts, generation);
      }
      status.textContent = `Signed in as ${user}. Counts read at ${new Date().toLocaleTimeString()}.`;
    } catch (e) {
      status.textContent = `Counts could not be read: ${e instanceof Error ? e.message : e}`;
    }
  }

  status.textContent = `Signed in as ${user}.`;
  if (pollMs > 0) {
    const loop = async () => {
      await refresh();
      setTimeout(loop, pollMs);
    };
    setTimeout(loop, pollMs);
  }
  // For tests and the curious: whether every button has settled.
  Object.assign(window, {
    tallyDemo: {
      user,
      ids,
      refresh,
      settled: () => [...reactions.values()].every((r) => !r.sending && r.wanted === undefined),
    },
  });
  document.body.dataset.ready = "true";
}

main().catch((e) => {
  const status = document.getElementById("status");
  if (status) status.textContent = `The demo could not start: ${e instanceof Error ? e.message : e}`;
  document.body.dataset.ready = "failed";
});
