import fs from "fs";

/** Reads a config file. */
function readConfig(path) {
  const raw = fs.readFileSync(path, "utf8");
  return JSON.parse(raw);
}

const double = (x) => x * 2;

class Queue {
  constructor() {
    this.items = [];
  }

  push(item) {
    this.items.push(item);
    return this.items.length;
  }

  pop() {
    return this.items.shift();
  }
}
