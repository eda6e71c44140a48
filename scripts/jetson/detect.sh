# shellcheck shell=bash
# Sourced by scripts/install_jetson.sh (its variables and helpers: say, note, warn, die, run).
# Which board this is: the L4T release, JetPack and the board's model.
# shellcheck disable=SC2154,SC2034  # read and set for scripts/install_jetson.sh

# jetpack_of L4T_VERSION -> JetPack release (map from jetson-stats' NVIDIA_JETPACK table).
jetpack_of() {
    case "$1" in
        35.1*) echo 5.0.2 ;; 35.2*) echo 5.1 ;; 35.3*) echo 5.1.1 ;; 35.4*) echo 5.1.2 ;;
        35.5*) echo 5.1.3 ;; 35.6.0*) echo 5.1.4 ;; 35.6*) echo 5.1.5 ;;
        36.2*) echo 6.0DP ;; 36.3*) echo 6.0 ;; 36.4.0* | 36.4.2*) echo 6.1 ;; 36.4.3*) echo 6.2 ;;
        36.4*) echo 6.2.1 ;; 36.5*) echo 6.2.2 ;; 38.*) echo 7.0 ;; 39.*) echo 7.2 ;;
        *) echo unknown ;;
    esac
}

# Checks: /etc/nv_tegra_release (or the nvidia-l4t-core package) for the L4T release and the board's
# model; sets IS_JETSON, L4T, JETPACK, BOARD and SUPPORTED (JetPack 6 = L4T R36, 7 = R38/R39).
detect_platform() {
    local rel="$PROBE_ROOT/etc/nv_tegra_release" model="$PROBE_ROOT/proc/device-tree/model" line major rev pkg
    if [ -r "$rel" ]; then
        line=$(head -n 1 "$rel")
        major=$(printf '%s\n' "$line" | sed -n 's/^# R\([0-9][0-9]*\) (release).*/\1/p')
        rev=$(printf '%s\n' "$line" | sed -n 's/.*REVISION: *\([0-9.][0-9.]*\).*/\1/p')
        [ -n "$major" ] && [ -n "$rev" ] && L4T="$major.$rev"
        IS_JETSON=1
    elif [ -z "$PROBE_ROOT" ] && command -v dpkg-query >/dev/null 2>&1 &&
        pkg=$(dpkg-query -W -f='${Version}' nvidia-l4t-core 2>/dev/null) && [ -n "$pkg" ]; then
        L4T=${pkg%%-*}
        IS_JETSON=1
    fi
    if [ -r "$model" ]; then
        BOARD=$(tr -d '\0' <"$model")
    fi
    [ "$IS_JETSON" -eq 1 ] || return 0
    JETPACK=$(jetpack_of "$L4T")
    case "$L4T" in
        36.* | 38.* | 39.*) SUPPORTED=1 ;;
        35.*) WHY_UNSUPPORTED="JetPack $JETPACK (L4T R$L4T) ships Python 3.8 and TensorRT 8.5 for it; chattts-appliance needs Python >= 3.10 with JetPack's TensorRT bindings. Upgrade to JetPack 6.x (L4T R36)." ;;
        "") WHY_UNSUPPORTED="cannot read the L4T release from $rel (or the nvidia-l4t-core package)" ;;
        *) WHY_UNSUPPORTED="L4T R$L4T (JetPack $JETPACK) is not supported; use JetPack 6.x (L4T R36) or 7.x (L4T R38/R39)" ;;
    esac
}
