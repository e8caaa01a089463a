// Run a MicroPython script under the WebAssembly port, with the firmware's lib/ in /lib.
//   node run_mpy.mjs FIRMWARE_LIB_DIR SCRIPT.py [EXTRA.py ...]
// EXTRA files (pubboot.py, test vectors made by the gateway's code) go to /lib too.
// The script's output goes to stdout; an uncaught exception exits 1.
// A line "# --- next run ---" splits the script into separate runPython calls
// (globals carry over): this port's gc.collect() reclaims only what no running
// call still holds, so a RAM measurement collects in a call of its own.
import { readFileSync, readdirSync, statSync } from "node:fs";
import { basename, join } from "node:path";
import { loadMicroPython } from "@micropython/micropython-webassembly-pyscript";

const [libDir, script, ...extra] = process.argv.slice(2);
const mp = await loadMicroPython({
  stdout: (line) => process.stdout.write(line + "\n"),
  stderr: (line) => process.stderr.write(line + "\n"),
});

function copy(src, dest) {
  mp.FS.mkdirTree(dest);
  for (const name of readdirSync(src)) {
    const from = join(src, name);
    if (statSync(from).isDirectory()) copy(from, `${dest}/${name}`);
    else if (name.endsWith(".py")) mp.FS.writeFile(`${dest}/${name}`, readFileSync(from));
  }
}
copy(libDir, "/lib");
for (const file of extra) mp.FS.writeFile(`/lib/${basename(file)}`, readFileSync(file));
mp.FS.mkdirTree("/flash");
try {
  for (const part of readFileSync(script, "utf8").split(/^# --- next run ---$/m)) {
    mp.runPython(part);
  }
} catch (err) {
  process.stderr.write(String(err) + "\n");
  process.exit(1);
}
