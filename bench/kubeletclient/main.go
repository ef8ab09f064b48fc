// drasil-kubelet-client calls a DRA kubelet plugin's dra.sock as kubelet does: grpc-go,
// one connection, DRAPlugin v1, one claim per call. bench/prepare.py runs it so that
// the latency and throughput figures are the plugin's as kubelet sees them, without
// the cost of a Python gRPC client in them.
//
// Output (stdout, JSON): latency p50/p99 of prepare, unprepare and the pair over
// -rounds sequential pairs of the first claim, and claims/s for each -inflight level
// (workers share the claims, each prepares and unprepares its own in a loop).
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
	"google.golang.org/grpc/credentials/insecure"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
)

// kubelet's own timeout for these calls.
const callTimeout = 45 * time.Second

func main() {
	socket := flag.String("socket", "", "the plugin's dra.sock")
	claimList := flag.String("claims", "", "namespace/name/uid,... (each allocated one device)")
	rounds := flag.Int("rounds", 300, "sequential prepare+unprepare pairs for the latency figures")
	seconds := flag.Float64("seconds", 5, "length of each throughput run")
	inflight := flag.String("inflight", "1,8,32", "claims in flight in the throughput runs")
	flag.Parse()
	if err := run(*socket, *claimList, *rounds, *seconds, *inflight); err != nil {
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
