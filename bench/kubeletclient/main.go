// drasil-kubelet-client calls a DRA kubelet plugin's dra.sock as kubelet does: grpc-go,
// one connection, DRAPlugin v1, one claim per call. bench/prepare.py runs it so that
// the latency and throughput figures are the plugin's as kubelet sees them, without
// the cost of a Python gRPC client in them.
//
// Output (stdout, JSON): latency p50/p99 of prepare, unprepare and the pair over
// -rounds sequential pairs of the first claim, and claims/s for each -inflight level
// (workers share the claims, each prepares and unprepares its own in a loop).
//
// -burst (bench/mps.py): every claim prepared at once, one call each (one goroutine
// per claim, kubelet's call timeout on each), and once all have returned every claim
// unprepared at once. A failed call (a gRPC error, or an error for its claim) is
// counted, not fatal. Output: the failed calls of each phase, each phase's wall time,
// p50/p99/max of one call of each phase (failed calls included) and the first error
// texts of each phase.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

// kubelet's own timeout for these calls.
const callTimeout = 45 * time.Second

// How many error texts of each burst phase are printed.
const errorsKept = 5

func main() {
	socket := flag.String("socket", "", "the plugin's dra.sock")
	claimList := flag.String("claims", "", "namespace/name/uid,... (each allocated one device)")
	rounds := flag.Int("rounds", 300, "sequential prepare+unprepare pairs for the latency figures")
	seconds := flag.Float64("seconds", 5, "length of each throughput run")
	inflight := flag.String("inflight", "1,8,32", "claims in flight in the throughput runs")
	burst := flag.Bool("burst", false, "prepare all claims at once (a call each), then unprepare all at once; "+
		"print failures and times instead of the latency and throughput figures")
	flag.Parse()
	var err error
	if *burst {
		err = runBurst(*socket, *claimList)
	} else {
		err = run(*socket, *claimList, *rounds, *seconds, *inflight)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "drasil-kubelet-client:", err)
		os.Exit(1)
	}
}

func run(socket, claimList string, rounds int, seconds float64, inflight string) error {
	claims, err := parseClaims(claimList)
	if err != nil {
		return err
	}
	levels, err := parseLevels(inflight)
	if err != nil {
		return err
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	client := drapb.NewDRAPluginClient(conn)
	lat, err := latency(client, claims[0], rounds)
	if err != nil {
		return err
	}
	rates := map[string]float64{}
	for _, n := range levels {
		rate, err := throughput(client, claims, n, time.Duration(seconds*float64(time.Second)))
		if err != nil {
			return err
		}
		rates[strconv.Itoa(n)] = rate
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"latency":                 lat,
		"throughput_claims_per_s": rates,
	})
}

func parseClaims(list string) ([]*drapb.Claim, error) {
	var claims []*drapb.Claim
	for _, item := range strings.Split(list, ",") {
		parts := strings.Split(item, "/")
		if len(parts) != 3 {
			return nil, fmt.Errorf("-claims: %q is not namespace/name/uid", item)
		}
		claims = append(claims, &drapb.Claim{Namespace: parts[0], Name: parts[1], Uid: parts[2]})
	}
	return claims, nil
}

func parseLevels(list string) ([]int, error) {
	var levels []int
	for _, item := range strings.Split(list, ",") {
		n, err := strconv.Atoi(item)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-inflight: %q is not a positive number", item)
		}
		levels = append(levels, n)
	}
	return levels, nil
}

// pair prepares and unprepares one claim; an error of either call or of the claim fails it.
func pair(client drapb.DRAPluginClient, claim *drapb.Claim) (time.Duration, time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	start := time.Now()
	prepared, err := client.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{claim}})
	if err != nil {
		return 0, 0, err
	}
	if e := prepared.GetClaims()[claim.Uid].GetError(); e != "" {
		return 0, 0, fmt.Errorf("prepare %s/%s: %s", claim.Namespace, claim.Name, e)
	}
	middle := time.Now()
	unprepared, err := client.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{claim}})
	if err != nil {
		return 0, 0, err
	}
	if e := unprepared.GetClaims()[claim.Uid].GetError(); e != "" {
		return 0, 0, fmt.Errorf("unprepare %s/%s: %s", claim.Namespace, claim.Name, e)
	}
	return middle.Sub(start), time.Since(middle), nil
}

func latency(client drapb.DRAPluginClient, claim *drapb.Claim, rounds int) (map[string]float64, error) {
	var prep, unprep, both []time.Duration
	for range rounds {
		p, u, err := pair(client, claim)
		if err != nil {
			return nil, err
		}
		prep, unprep, both = append(prep, p), append(unprep, u), append(both, p+u)
	}
	return map[string]float64{
		"prepare_p50_ms":   quantile(prep, 0.5),
		"prepare_p99_ms":   quantile(prep, 0.99),
		"unprepare_p50_ms": quantile(unprep, 0.5),
		"unprepare_p99_ms": quantile(unprep, 0.99),
		"pair_p50_ms":      quantile(both, 0.5),
		"pair_p99_ms":      quantile(both, 0.99),
	}, nil
}

// quantile in milliseconds, picked as bench/prepare.py's percentile does.
func quantile(values []time.Duration, q float64) float64 {
	sorted := slices.Clone(values)
	slices.Sort(sorted)
	i := min(len(sorted)-1, int(q*float64(len(sorted))))
	return float64(sorted[i]) / float64(time.Millisecond)
}

func throughput(client drapb.DRAPluginClient, claims []*drapb.Claim, workers int, length time.Duration) (float64, error) {
	var done atomic.Int64
	var failure atomic.Value
	var wg sync.WaitGroup
	start := time.Now()
	stop := start.Add(length)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []*drapb.Claim
			for i := w; i < len(claims); i += workers {
				mine = append(mine, claims[i])
			}
			for time.Now().Before(stop) && len(mine) > 0 {
				for _, claim := range mine {
					if _, _, err := pair(client, claim); err != nil {
						failure.Store(err)
						return
					}
					done.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if err, ok := failure.Load().(error); ok {
		return 0, err
	}
	return float64(done.Load()) / time.Since(start).Seconds(), nil
}

// outcome is one call of a burst: how long it took and why it failed (nil: it did not).
type outcome struct {
	latency time.Duration
	err     error
}

func runBurst(socket, claimList string) error {
	claims, err := parseClaims(claimList)
	if err != nil {
		return err
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	// kubelet's connection to a registered plugin is up before a Pod's claims come.
	if err := connected(conn, 10*time.Second); err != nil {
		return err
	}
	client := drapb.NewDRAPluginClient(conn)
	prepareWall, prepared := burstPhase(claims, func(ctx context.Context, claim *drapb.Claim) error {
		response, err := client.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{claim}})
		if err != nil {
			return fmt.Errorf("prepare %s/%s: %w", claim.Namespace, claim.Name, err)
		}
		result, ok := response.GetClaims()[claim.Uid]
		if !ok {
			return fmt.Errorf("prepare %s/%s: no result for the claim", claim.Namespace, claim.Name)
		}
		if e := result.GetError(); e != "" {
			return fmt.Errorf("prepare %s/%s: %s", claim.Namespace, claim.Name, e)
		}
		return nil
	})
	unprepareWall, unprepared := burstPhase(claims, func(ctx context.Context, claim *drapb.Claim) error {
		response, err := client.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: []*drapb.Claim{claim}})
		if err != nil {
			return fmt.Errorf("unprepare %s/%s: %w", claim.Namespace, claim.Name, err)
		}
		result, ok := response.GetClaims()[claim.Uid]
		if !ok {
			return fmt.Errorf("unprepare %s/%s: no result for the claim", claim.Namespace, claim.Name)
		}
		if e := result.GetError(); e != "" {
			return fmt.Errorf("unprepare %s/%s: %s", claim.Namespace, claim.Name, e)
		}
		return nil
	})
	out := map[string]any{
		"claims":         len(claims),
		"call_timeout_s": callTimeout.Seconds(),
	}
	for name, phase := range map[string]struct {
		wall     time.Duration
		outcomes []outcome
	}{"prepare": {prepareWall, prepared}, "unprepare": {unprepareWall, unprepared}} {
		var latencies []time.Duration
		errors := []string{}
		failed := 0
		for _, o := range phase.outcomes {
			latencies = append(latencies, o.latency)
			if o.err != nil {
				failed++
				if len(errors) < errorsKept {
					errors = append(errors, o.err.Error())
				}
			}
		}
		out["failed_"+name+"s"] = failed
		out[name+"_wall_ms"] = float64(phase.wall) / float64(time.Millisecond)
		out[name+"_p50_ms"] = quantile(latencies, 0.5)
		out[name+"_p99_ms"] = quantile(latencies, 0.99)
		out[name+"_max_ms"] = quantile(latencies, 1)
		out[name+"_errors"] = errors
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

// connected waits until the connection is up (or the timeout passes).
func connected(conn *grpc.ClientConn, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	conn.Connect()
	for {
		state := conn.GetState()
		if state == connectivity.Ready {
			return nil
		}
		if !conn.WaitForStateChange(ctx, state) {
			return fmt.Errorf("no connection to the plugin within %s (%s)", timeout, state)
		}
	}
}

// burstPhase makes one call per claim, all at once (released together once every
// goroutine runs), each under kubelet's call timeout; the wall time until the last
// returned, and each call's outcome (the errors in the order the calls ended).
func burstPhase(claims []*drapb.Claim, call func(context.Context, *drapb.Claim) error) (time.Duration, []outcome) {
	outcomes := make([]outcome, 0, len(claims))
	var mu sync.Mutex
	var ready, done sync.WaitGroup
	release := make(chan struct{})
	for _, claim := range claims {
		ready.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			ready.Done()
			<-release
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			began := time.Now()
			err := call(ctx, claim)
			o := outcome{time.Since(began), err}
			mu.Lock()
			outcomes = append(outcomes, o)
			mu.Unlock()
		}()
	}
	ready.Wait()
	start := time.Now()
	close(release)
	done.Wait()
	return time.Since(start), outcomes
}
