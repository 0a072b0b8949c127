package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestBenchMigrate measures migration downtime between two network
// namespaces against `criu dump -D` to tmpfs plus `criu restore -D` from
// tmpfs on one host. It runs only with GPUCR_BENCH_MIGRATE=1 (see
// scripts/bench-migrate.sh): a fresh target for every measurement, the
// variants interleaved round by round, medians and ratios at the end.
//
//	GPUCR_BENCH_MB        target size in MiB (1024)
//	GPUCR_BENCH_ROUNDS    rounds (3)
//	GPUCR_BENCH_VARIANTS  e.g. "plain s1 s2 s4 s2-none s2-nokeep s2-hashes s2-before"
//	GPUCR_BENCH_OUT       file for the markdown results
//	GPUCR_BENCH_SHAPE     shape the link to this rate with tc tbf (e.g. 10gbit)
//	GPUCR_BENCH_BEFORE    another gpucr-stream build: variants with -before
//	                      run their receiver with it
//	GPUCR_BENCH_REWRITE   the target rewrites this percentage of its pages
//	                      a second while it runs (e2e/target --rewrite-pct)
//	GPUCR_BENCH_RECV_MEMORY  the receiver's --memory-limit (2GiB)
//
// Variants sN migrate with --precopy on; -off with --precopy off; -lazy
// to a receiver that restores with --lazy-pages.
func TestBenchMigrate(t *testing.T) {
	if os.Getenv("GPUCR_BENCH_MIGRATE") != "1" {
		t.Skip("benchmark: set GPUCR_BENCH_MIGRATE=1 (scripts/bench-migrate.sh)")
	}
	mb := envInt("GPUCR_BENCH_MB", 1024)
	rounds := envInt("GPUCR_BENCH_ROUNDS", 3)
	variants := strings.Fields(os.Getenv("GPUCR_BENCH_VARIANTS"))
	if len(variants) == 0 {
		variants = []string{"plain", "s1", "s2", "s4"}
	}
	e := newMigrateEnv(t)
	// Every round of every variant under one deadline: the tests' 4
	// minutes are too short for 1 GiB targets on a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	e.ctx = ctx
	if rate := os.Getenv("GPUCR_BENCH_SHAPE"); rate != "" {
		e.net.ShapeBurst(t, rate, "8mb")
	}
	shm, err := os.MkdirTemp("/dev/shm", "gcs-bench-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(shm)

	type sample struct {
		down, dump, restore float64
		raw, wire, stream   int64
		phases              string
	}
	results := map[string][]sample{}
	for r := range rounds {
		for _, v := range variants {
			name := fmt.Sprintf("r%d-%s", r, v)
			tg, before := e.startTarget(name, mb, "--rewrite-pct", strconv.Itoa(envInt("GPUCR_BENCH_REWRITE", 0)))
			var s sample
			if v == "plain" {
				img := mkdir(t, filepath.Join(shm, name))
				start := time.Now()
				var err error
				InNetns(t, e.net.A, func() {
					err = RunCRIU(e.ctx, t, "dump", "-D", img, "-t", strconv.Itoa(tg.PID()), "-o", "dump.log")
				})
				if err != nil {
					t.Fatal(err)
				}
				s.dump = time.Since(start).Seconds()
				if err := tg.WaitGone(e.ctx); err != nil {
					t.Fatal(err)
				}
				s.raw = dirSize(t, img)
				start = time.Now()
				InNetns(t, e.net.A, func() {
					err = RunCRIU(e.ctx, t, "restore", "-D", img, "--restore-detached", "-o", "restore.log")
				})
				if err != nil {
					t.Fatal(err)
				}
				s.restore = time.Since(start).Seconds()
				s.down = s.dump + s.restore
				os.RemoveAll(img)
			} else {
				args := []string{"--json", "--memory-limit", "1GiB"}
				opt := strings.Split(v, "-")
				args = append(args, "--streams", strings.TrimPrefix(opt[0], "s"))
				e.recvBin = ""
				precopy := "on"
				recvArgs := []string{"--restore", "--json", "--criu", e.criu, "--memory-limit", envStr("GPUCR_BENCH_RECV_MEMORY", "2GiB"), "--spill-dir", shm}
				for _, o := range opt[1:] {
					switch o {
					case "before":
						if e.recvBin = os.Getenv("GPUCR_BENCH_BEFORE"); e.recvBin == "" {
							t.Fatalf("variant %s: set GPUCR_BENCH_BEFORE to the receiver's binary", v)
						}
					case "none", "lz4", "zstd":
						args = append(args, "--codec", o)
					case "nokeep":
						args = append(args, "--keep-dir", "none")
					case "hashes":
						args = append(args, "--chunk-hashes")
					case "off":
						precopy = "off"
					case "lazy":
						recvArgs = append(recvArgs, "--lazy-pages")
					default:
						t.Fatalf("variant %s: unknown option %q", v, o)
					}
				}
				args = append(args, "--precopy", precopy)
				var rout, mout bytes.Buffer
				recv := e.startReceiver(&rout, recvArgs...)
				m := e.migrate(tg, &mout, args...)
				if err := m.wait(e.ctx); err != nil {
					t.Fatalf("%s: %v; receiver: %v", name, err, recv.wait(e.ctx))
				}
				if err := recv.wait(e.ctx); err != nil {
					t.Fatalf("%s: receive: %v", name, err)
				}
				var res migratePrecopyJSON
				if err := json.Unmarshal(mout.Bytes(), &res); err != nil {
					t.Fatalf("%s: %v: %s", name, err, mout.String())
				}
				var sizes struct {
					StreamBytes int64 `json:"stream_bytes"`
				}
				json.Unmarshal(mout.Bytes(), &sizes)
				s.down, s.raw, s.wire, s.stream = res.DowntimeSecs, res.RawBytes, res.WireBytes, sizes.StreamBytes
				var ps []string
				for _, p := range res.Phases {
					ps = append(ps, fmt.Sprintf("%s %.2f", p.Name, p.Secs))
				}
				if p := res.Precopy; p.Method != "" && p.Method != "off" {
					var rs []string
					for _, r := range p.Rounds {
						rs = append(rs, fmt.Sprintf("%.2fs %.0f MiB", r.Secs, float64(r.SentBytes)/(1<<20)))
					}
					ps = append(ps, fmt.Sprintf("pre-copy rounds [%s], final dump %.1f MiB on the wire, %.0f MiB by reference",
						strings.Join(rs, ", "), float64(p.FinalWireBytes)/(1<<20), float64(p.FinalRefBytes)/(1<<20)))
				}
				var rres struct {
					CRIUWaited float64 `json:"criu_waited_seconds"`
					Phases     []struct {
						Name string  `json:"name"`
						Secs float64 `json:"seconds"`
					} `json:"phases"`
				}
				if json.Unmarshal(rout.Bytes(), &rres) == nil {
					if rres.CRIUWaited > 0 {
						ps = append(ps, fmt.Sprintf("(receiver's criu waited %.2f for the commit)", rres.CRIUWaited))
					}
					var rps []string
					for _, p := range rres.Phases {
						rps = append(rps, fmt.Sprintf("%s %.2f", p.Name, p.Secs))
					}
					ps = append(ps, "receiver: "+strings.Join(rps, ", "))
				}
				s.phases = strings.Join(ps, ", ")
			}
			after, err := tg.Prove(e.ctx)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if err := after.Check(before); err != nil {
				t.Fatalf("%s: restored target: %v", name, err)
			}
			tg.Kill()
			os.RemoveAll(tg.Dir())
			t.Logf("%s: downtime %.2fs (dump %.2f restore %.2f) raw %d wire %d; %s", name, s.down, s.dump, s.restore, s.raw, s.wire, s.phases)
			results[v] = append(results[v], s)
		}
	}

	med := func(v string, f func(sample) float64) float64 {
		var xs []float64
		for _, s := range results[v] {
			xs = append(xs, f(s))
		}
		sort.Float64s(xs)
		if len(xs) == 0 {
			return 0
		}
		return xs[len(xs)/2]
	}
	var out strings.Builder
	link := "veth, unshaped"
	if rate := os.Getenv("GPUCR_BENCH_SHAPE"); rate != "" {
		link = "veth shaped to " + rate + " (tc tbf)"
	}
	load := "idle"
	if pct := envInt("GPUCR_BENCH_REWRITE", 0); pct > 0 {
		load = fmt.Sprintf("rewriting %d%% of its pages a second", pct)
	}
	fmt.Fprintf(&out, "Target %d MiB (%s), %d rounds, medians; machine: %d CPUs; link: %s.\n\n", mb, load, rounds, nprocs(), link)
	base := med("plain", func(s sample) float64 { return s.down })
	fmt.Fprintf(&out, "| variant | downtime | vs plain dump+restore | raw image | stream | on the wire | wire / raw | runs |\n|---|---|---|---|---|---|---|---|\n")
	for _, v := range variants {
		d := med(v, func(s sample) float64 { return s.down })
		raw := med(v, func(s sample) float64 { return float64(s.raw) })
		wire := med(v, func(s sample) float64 { return float64(s.wire) })
		stream := med(v, func(s sample) float64 { return float64(s.stream) })
		var runs []string
		for _, s := range results[v] {
			runs = append(runs, fmt.Sprintf("%.2f", s.down))
		}
		label := "migrate --streams " + strings.ReplaceAll(strings.TrimPrefix(v, "s"), "-", " ")
		label = strings.Replace(label, " off", " --precopy off", 1)
		if v == "plain" {
			label = fmt.Sprintf("criu dump -D tmpfs (%.2fs) + criu restore -D tmpfs (%.2fs)",
				med(v, func(s sample) float64 { return s.dump }), med(v, func(s sample) float64 { return s.restore }))
		}
		ratio, wr, ws, st := "1.00x", "-", "-", "-"
		if v != "plain" {
			ratio = "-"
			if base > 0 {
				ratio = fmt.Sprintf("%.2fx", d/base)
			}
			ws = fmt.Sprintf("%.0f MiB", wire/(1<<20))
			st = fmt.Sprintf("%.0f MiB", stream/(1<<20))
			wr = fmt.Sprintf("%.3f", wire/raw)
		}
		fmt.Fprintf(&out, "| %s | %.2f s | %s | %.0f MiB | %s | %s | %s | %s |\n", label, d, ratio, raw/(1<<20), st, ws, wr, strings.Join(runs, " "))
	}
	// Every variant against stop-and-copy restored from the stream, with
	// as many streams (sN-off).
	for _, v := range variants {
		off := strings.SplitN(v, "-", 2)[0] + "-off"
		if len(results[off]) == 0 || v == off || v == "plain" {
			continue
		}
		fmt.Fprintf(&out, "\nDowntime of %s / of %s: %.2fx (medians %.2f s / %.2f s).\n", v, off, med(v, func(s sample) float64 { return s.down })/med(off, func(s sample) float64 { return s.down }),
			med(v, func(s sample) float64 { return s.down }), med(off, func(s sample) float64 { return s.down }))
	}
	fmt.Fprintf(&out, "\nPhases of each migration (seconds):\n\n")
	for _, v := range variants {
		for i, s := range results[v] {
			if s.phases != "" {
				fmt.Fprintf(&out, "- %s round %d: %s\n", v, i, s.phases)
			}
		}
	}
	t.Logf("\n%s", out.String())
	if p := os.Getenv("GPUCR_BENCH_OUT"); p != "" {
		if err := os.WriteFile(p, []byte(out.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func envStr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func dirSize(t *testing.T, dir string) int64 {
	var n int64
	filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() && strings.HasSuffix(p, ".img") {
			n += info.Size()
		}
		return nil
	})
	return n
}

func nprocs() int {
	out, err := exec.Command("nproc").Output()
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	return n
}
